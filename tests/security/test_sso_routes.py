"""The single sign-on routes (issue 26) configured against a real OpenID provider (oidc-provider,
tests/identity): who gets what from each, and a fuzz run of the callback's query string (any code,
state, error, iss or other parameter gives a sign-in page saying why, 4xx, never a 500 or a session)."""
from __future__ import annotations

import pytest
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.identity.conftest import (
    CLIENT_ID,
    CLIENT_SECRET,
    oidc_provider,  # noqa: F401 (the fixture)
)
from tests.security.routes import SSO_PAGES, page_routes

pytestmark = pytest.mark.django_db


@pytest.fixture
def sso(settings, oidc_provider):  # noqa: F811
    settings.OIDC_ISSUER = oidc_provider.issuer
    settings.OIDC_CLIENT_ID = CLIENT_ID
    settings.OIDC_CLIENT_SECRET = CLIENT_SECRET
    settings.OIDC_SCOPES = "openid profile email groups"
    return oidc_provider


def test_the_sso_routes_are_the_ones_the_matrix_knows():
    assert SSO_PAGES == {path for path, _ in page_routes() if path.startswith("/accounts/oidc/")}
    assert all(role is None for path, role in page_routes() if path in SSO_PAGES)


def test_sso_routes_by_caller(sso, admin, operator, viewer):
    callers = {"anonymous": None, "viewer": viewer, "operator": operator, "admin": admin}
    for name, account in callers.items():
        client = Client()
        if account is not None:
            client.force_login(account.user)
        start = client.get("/accounts/oidc/login/")
        assert start.status_code == 302 and start["Location"].startswith(f"{sso.issuer}/auth?"), name
        assert client.get("/accounts/oidc/callback/").status_code == 400, name  # no state: refused
        assert client.post("/accounts/oidc/callback/").status_code in (403, 405), name  # GET only
        assert client.post("/accounts/oidc/login/").status_code in (403, 405), name
    # A redirect target off this site is dropped, not followed after the sign-in.
    client = Client()
    client.get("/accounts/oidc/login/", {"next": "https://evil.example/"})
    assert client.session["xgen_oidc_next"] == ""
    client.get("/accounts/oidc/login/", {"next": "/models/"})
    assert client.session["xgen_oidc_next"] == "/models/"


text = st.text(max_size=60)
params = st.dictionaries(st.sampled_from(["code", "state", "error", "error_description", "iss", "session_state",
                                          "x"]), text, max_size=5)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(query=params, started=st.booleans())
def test_the_callback_refuses_any_query_without_a_500(sso, query, started):
    client = Client()
    if started:  # a real state in the session, so a made-up code goes to the provider's token endpoint
        location = client.get("/accounts/oidc/login/")["Location"]
        state = location.split("state=")[1].split("&")[0]
        query = {**query, "state": state}
    response = client.get("/accounts/oidc/callback/", query)
    assert response.status_code in (400, 502), (query, response.status_code)
    assert b"Sign-in with" in response.content
    assert "_auth_user_id" not in client.session
