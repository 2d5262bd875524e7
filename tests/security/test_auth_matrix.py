"""The auth matrix, generated from the URLconf and the API: every page and every operation x
anonymous / bad key / viewer / operator / admin. A new route cannot skip auth: it shows up here."""
from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from xgenconsole.auth import ApiKeyAuth, SessionAuthWithCsrf
from xgenconsole.models import ROLE_RANK, Role

PUBLIC_PAGES = {"/healthz", "/readyz", "/accounts/login/"}
SAMPLE = {"int": "1", "str": "n", "path": "gguf/x", "slug": "x", "uuid": "00000000-0000-0000-0000-000000000000"}


def _fill(route: str) -> str:
    return re.sub(r"<(?:(\w+):)?\w+>", lambda m: SAMPLE[m.group(1) or "str"], route)


def page_routes() -> list[tuple[str, str | None]]:
    """(path, required role or None) for every non-API page."""
    out = []

    def walk(patterns, prefix=""):
        for p in patterns:
            if isinstance(p, URLResolver):
                walk(p.url_patterns, prefix + str(p.pattern))
            elif isinstance(p, URLPattern):
                route = prefix + str(p.pattern)
                if route.startswith(("api/", "^api/")):
                    continue
                path = "/" + _fill(route)
                out.append((path, getattr(p.callback, "required_role", None)))

    walk(get_resolver().url_patterns)
    return out


def api_operations() -> list[tuple[str, str, str]]:
    """(method, concrete path, required role) for every Ninja operation."""
    from xgenconsole.api import api

    out = []
    for bound in api._get_bound_routers():  # ninja clones each operation with its effective auth
        for path, view in bound.path_operations.items():
            full = "/api/" + "/".join(p.strip("/") for p in (bound.prefix, path) if p.strip("/"))
            full = re.sub(r"\{(?:(\w+):)?(\w+)\}", lambda m: "gguf/x" if m.group(1) == "path" else "1", full)
            for op in view.operations:
                assert op.auth_callbacks, f"{full} has no auth"
                roles = {cb.role for cb in op.auth_callbacks if isinstance(cb, ApiKeyAuth | SessionAuthWithCsrf)}
                assert len(roles) == 1 and len(op.auth_callbacks) == 2, f"{full}: use auth=auth_for(role)"
                role = roles.pop()
                for method in op.methods:
                    out.append((method, full, role))
    return out


@pytest.mark.django_db
def test_api_docs_need_login(viewer):
    for path in ("/api/docs", "/api/openapi.json"):
        response = Client().get(path)
        assert response.status_code == 302 and response["Location"].startswith("/accounts/login/"), path
        client = Client()
        client.force_login(viewer.user)
        assert client.get(path).status_code == 200, path
    schema = client.get("/api/openapi.json").json()
    assert schema["info"]["title"] == "XGEN Console API"


def test_the_matrix_sees_every_route():
    pages = [p for p, _ in page_routes()]
    assert {"/models/", "/instances/", "/gpus/", "/downloads/", "/keys/", "/users/"} <= set(pages)
    ops = api_operations()
    assert ("GET", "/api/hardware/nodes", "viewer") in ops


@pytest.mark.django_db
def test_pages_by_role(admin, operator, viewer):
    accounts = {"viewer": viewer, "operator": operator, "admin": admin}
    anon = Client()
    checked = 0
    for path, role in page_routes():
        anon_status = anon.get(path).status_code
        if path in PUBLIC_PAGES:
            assert anon_status in (200, 503), path
            continue
        assert anon_status == 302, (path, anon_status)
        for name, account in accounts.items():
            client = Client()
            client.force_login(account.user)
            response = client.get(path)
            status = response.status_code
            if status == 302:  # a redirect elsewhere (home -> instances) is fine, to login is not
                assert not response["Location"].startswith("/accounts/login/"), (path, name)
                status = 200
            if role and ROLE_RANK[Role(name)] < ROLE_RANK[Role(role)]:
                assert status == 403, (path, name, status)
            else:
                assert status not in (401, 403) and status < 500, (path, name, status)
            checked += 1
    assert checked >= 18


@pytest.mark.django_db
def test_api_by_role(client, admin, operator, viewer):
    accounts = {"viewer": viewer, "operator": operator, "admin": admin}
    checked = 0
    for method, path, role in api_operations():
        call = getattr(client, method.lower())
        kwargs = {"content_type": "application/json"}
        if method != "GET":
            kwargs["data"] = {}
        for label, headers in (("anonymous", {}), ("bad key", {"HTTP_AUTHORIZATION": "Bearer xgen_bogus"})):
            response = call(path, **kwargs, **headers)
            assert response.status_code == 401, (method, path, label, response.status_code)
            assert set(response.json()["error"]) == {"message", "type", "code"}
        for name, account in accounts.items():
            response = call(path, **kwargs, HTTP_AUTHORIZATION=f"Bearer {account.key}")
            if ROLE_RANK[Role(name)] < ROLE_RANK[Role(role)]:
                assert response.status_code == 403, (method, path, name, response.status_code)
                assert response.json()["error"]["code"] == "insufficient_role"
            else:
                assert response.status_code not in (401, 403), (method, path, name, response.status_code)
                assert response.status_code < 500, (method, path, name, response.status_code, response.content[:300])
            checked += 1
    assert checked >= 3
