"""Login, roles and API auth across the project's own routes."""
import pytest
from django.urls import reverse

from accounts.credentials import key_cache
from tests.conftest import bearer
from tests.security.routes import PUBLIC_PAGES, page_routes


@pytest.mark.django_db
def test_every_page_redirects_anonymous_users_to_login(client):
    paths = [path for path, _role in page_routes() if path not in PUBLIC_PAGES]
    assert "/models/" in paths and "/keys/" in paths
    for path in paths:
        response = client.get(path)
        assert response.status_code == 302, path
        assert response["Location"].startswith("/accounts/login/"), path


@pytest.mark.django_db
def test_every_api_route_answers_401_in_openai_shape(client):
    from xgenconsole.api import api

    schema = api.get_openapi_schema()
    checked = 0
    for path, ops in schema["paths"].items():
        concrete = path.replace("{id}", "1").replace("{job_id}", "1").replace("{path}", "x")
        for method in ops:
            response = getattr(client, method)(concrete, content_type="application/json", data={} if method != "get" else None)
            assert response.status_code == 401, (method, path, response.status_code)
            body = response.json()
            assert set(body["error"]) == {"message", "type", "code"}, (method, path)
            checked += 1
    assert checked >= 1
    # Unknown API paths answer JSON too, never an HTML page.
    response = client.get("/api/does-not-exist")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


@pytest.mark.django_db
def test_bad_and_revoked_keys_are_refused(client, viewer):
    assert client.get("/api/hardware/nodes", **bearer("xgen_not-a-key")).status_code == 401
    assert client.get("/api/hardware/nodes", **bearer(viewer.key)).status_code == 200
    from accounts.models import ApiKey
    from accounts.services import revoke_api_key

    revoke_api_key(key=ApiKey.objects.get(user=viewer.user))
    assert client.get("/api/hardware/nodes", **bearer(viewer.key)).status_code == 401


@pytest.mark.django_db
def test_deactivated_user_key_stops_working(client, viewer):
    assert client.get("/api/hardware/nodes", **bearer(viewer.key)).status_code == 200
    viewer.user.is_active = False
    viewer.user.save()
    key_cache.clear()
    assert client.get("/api/hardware/nodes", **bearer(viewer.key)).status_code == 401


@pytest.mark.django_db
def test_wrong_password_shows_a_message_not_an_error(client, admin):
    response = client.post(reverse("login"), {"username": admin.user.username, "password": "wrong"})
    assert response.status_code == 200
    assert b"do not match" in response.content


@pytest.mark.django_db
def test_login_then_pages_render(client, viewer):
    response = client.post(reverse("login"), {"username": viewer.user.username, "password": viewer.password})
    assert response.status_code == 302
    for name in ("models", "instances", "gpus", "downloads"):
        response = client.get(reverse(name))
        assert response.status_code == 200, name
        assert b"victor-viewer" in response.content


@pytest.mark.django_db
def test_admin_pages_need_admin(client, viewer, operator):
    for account in (viewer, operator):
        client.force_login(account.user)
        assert client.get(reverse("users")).status_code == 403
        assert client.get(reverse("keys")).status_code == 403
        assert client.post(reverse("keys"), {"name": "x", "user": account.user.pk}).status_code == 403


@pytest.mark.django_db
def test_session_api_writes_need_csrf(admin):
    from django.test import Client

    csrf_client = Client(enforce_csrf_checks=True)
    csrf_client.force_login(admin.user)
    assert csrf_client.get("/api/hardware/nodes").status_code == 200
    from xgenconsole.api import api

    posts = [p for p, ops in api.get_openapi_schema()["paths"].items() if "post" in ops]
    for path in posts:
        response = csrf_client.post(path, data={}, content_type="application/json")
        assert response.status_code in (401, 403), path
        assert "error" in response.json()


@pytest.mark.django_db
def test_unknown_api_paths_answer_json_for_session_posts_too(admin):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(admin.user)
    response = client.post("/api/nope/1", data={}, content_type="application/json")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


@pytest.mark.django_db
def test_an_api_call_while_the_database_connection_is_lost_is_503(client, admin, monkeypatch):
    from django.db import InterfaceError, OperationalError

    from accounts import auth

    def lost(raw):
        raise InterfaceError("connection already closed")

    monkeypatch.setattr(auth, "lookup_key", lost)
    response = client.get("/api/hardware/nodes", **bearer(admin.key))
    assert response.status_code == 503
    assert response.json()["error"] == {"message": "The database is unavailable; try again in a moment.",
                                        "type": "service_unavailable", "code": "database_unavailable"}

    def broken_query(raw):
        raise OperationalError("a query's own error (a lock timeout), not a lost connection")

    monkeypatch.setattr(auth, "lookup_key", broken_query)
    assert client.get("/api/hardware/nodes", **bearer(admin.key)).status_code == 500
