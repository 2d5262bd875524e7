"""The auth matrix, generated from the URLconf and the API: every page and every operation x
anonymous / bad key / viewer / operator / admin. A new route cannot skip auth: it shows up here."""
from __future__ import annotations

import pytest
from django.test import Client

from accounts.models import ROLE_RANK, Role
from tests.security.routes import (
    ADDED_API,
    ADDED_PAGES,
    MISSING_ID,
    PUBLIC_PAGES,
    SSO_PAGES,
    api_operations,
    page_routes,
)


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
    assert ADDED_API <= set(ops), ADDED_API - set(ops)
    assert ADDED_PAGES <= set(page_routes()), ADDED_PAGES - set(page_routes())
    # Uploads are jobs: viewers may watch them, operators start and cancel them.
    assert {("POST", "/api/storage/upload", "operator"), ("GET", "/api/storage/uploads", "viewer"),
            ("GET", f"/api/storage/uploads/{MISSING_ID}", "viewer"),
            ("POST", f"/api/storage/uploads/{MISSING_ID}/cancel", "operator")} <= set(ops)
    assert "/models/uploads/1/cancel/" in pages
    # Rerank and score (issue 15): inference, open to every role.
    assert {("POST", "/api/inference/v1/rerank", "viewer"), ("POST", "/api/inference/v1/score", "viewer")} <= set(ops)
    # Node caches: the hub's router at the node's URL; viewers look, operators evict, verify and
    # cancel either (issue 24 #4: cache jobs cancel as the other jobs do).
    assert {("GET", f"/api/hardware/nodes/{MISSING_ID}/cache", "viewer"),
            ("POST", f"/api/hardware/nodes/{MISSING_ID}/cache/evict", "operator"),
            ("POST", f"/api/hardware/nodes/{MISSING_ID}/cache/verify", "operator"),
            ("GET", f"/api/hardware/nodes/{MISSING_ID}/cache/jobs/{MISSING_ID}", "viewer"),
            ("POST", f"/api/hardware/nodes/{MISSING_ID}/cache/jobs/{MISSING_ID}/cancel", "operator")} <= set(ops)
    assert ("/nodes/n/cache/jobs/1/cancel/", "operator") in page_routes()


@pytest.mark.django_db
def test_pages_by_role(admin, operator, viewer):
    accounts = {"viewer": viewer, "operator": operator, "admin": admin}
    anon = Client()
    checked = 0
    for path, role in page_routes():
        anon_status = anon.get(path).status_code
        if path in PUBLIC_PAGES:
            assert anon_status in ((404,) if path in SSO_PAGES else (200, 503)), path
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


def _needed_scope(method: str, path: str) -> str:
    if path.startswith("/api/inference/"):
        return "inference"
    return "read" if method == "GET" else "manage"


@pytest.mark.django_db
def test_api_by_key_scope(client, admin):
    """Every operation x an admin's key with one scope each (issue 34 #20): the scope it needs
    (inference under /api/inference/, read for GET, manage for other writes) or 403 insufficient_scope."""
    from accounts.services import create_api_key

    keys = {s: create_api_key(user=admin.user, name=f"only-{s}", scopes=[s])[1] for s in ("inference", "read", "manage")}
    checked = 0
    for method, path, _role in api_operations():
        call = getattr(client, method.lower())
        kwargs = {"content_type": "application/json", **({"data": {}} if method != "GET" else {})}
        needed = _needed_scope(method, path)
        for scope, key in keys.items():
            response = call(path, **kwargs, HTTP_AUTHORIZATION=f"Bearer {key}")
            if scope != needed:
                assert response.status_code == 403, (method, path, scope, response.status_code)
                assert response.json()["error"]["code"] == "insufficient_scope", (method, path, scope)
            else:
                assert response.status_code not in (401, 403), (method, path, scope, response.status_code)
                assert response.status_code < 500, (method, path, scope, response.status_code)
            checked += 1
    assert checked >= 3 * 40


@pytest.mark.django_db(transaction=True)
async def test_proxy_routes_by_key_scope(admin):
    """The proxy's routes (inference; /metrics is a read) x a key with one scope each."""
    from asgiref.sync import sync_to_async

    from accounts.services import create_api_key
    from tests.asgi_calls import call_proxy
    from tests.security.routes import PROXY_ROUTES

    make = sync_to_async(lambda s: create_api_key(user=admin.user, name=f"only-{s}", scopes=[s])[1])
    keys = {s: await make(s) for s in ("inference", "read", "manage")}

    for method, path, _role in PROXY_ROUTES:
        needed = "read" if path == "/metrics" else "inference"
        for scope, key in keys.items():
            status, body = await call_proxy(method, path, key, b"{}")
            if scope != needed:
                # /v1/messages answers in Anthropic's shape (no code): the message names the scope.
                assert status == 403 and f"needs the {needed} scope".encode() in body, (method, path, scope, status)
            else:
                # No model is loaded here: 503 no_backend or 404 is an answer past auth; 500 never.
                assert status not in (401, 403, 500), (method, path, scope, status, body[:200])


@pytest.mark.django_db
def test_a_team_lead_reaches_its_own_team_and_nothing_of_another(client):
    """Every team route (API and pages) x a team lead (a viewer) on its own team and on another:
    its own team's reads and key writes pass; another team's answer 404 (as a team that does not
    exist: not even its id is confirmed), and the admin-only writes 403 on both."""
    from accounts.services import add_member, create_api_key, create_team, create_user

    mine, theirs = create_team(name="Mine"), create_team(name="Theirs")
    lead = create_user(username="lena-lead", role="viewer", password="lena-lead-pass-1")
    add_member(team=mine, user=lead, is_lead=True)
    _, key = create_api_key(user=lead, name="lena-key")
    browser = Client()
    browser.force_login(lead)
    routes = [r for r in api_operations() if r[1].startswith(f"/api/teams/{MISSING_ID}")]
    assert len(routes) >= 8
    for method, path, role in routes:
        call = getattr(client, method.lower())
        for team, own in ((mine, True), (theirs, False)):
            concrete = path.replace(MISSING_ID, str(team.pk), 1)
            body = {"name": "k"} if method == "POST" else {}
            response = call(concrete, data=body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}")
            status = response.status_code
            if role == "admin":
                assert status == 403 and response.json()["error"]["code"] == "insufficient_role", (method, concrete)
            elif own:
                assert status not in (401, 403) and status < 500, (method, concrete, status, response.content[:300])
                answer = response.json()
                assert not isinstance(answer, dict) or answer.get("error", {}).get("code") != "team_not_found", (
                    method, concrete)
            else:
                assert status == 404 and response.json()["error"]["code"] == "team_not_found", (method, concrete, status)
    assert browser.get(f"/teams/{mine.pk}/").status_code == 200
    assert browser.get(f"/teams/{theirs.pk}/").status_code == 404
    assert browser.post(f"/teams/{theirs.pk}/", {"action": "key_create", "name": "x"}).status_code == 404
    assert browser.post(f"/teams/{mine.pk}/", {"action": "limits", "rpm": "1"}).status_code == 404  # admins only
