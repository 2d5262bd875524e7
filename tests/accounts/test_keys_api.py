"""Keys with limits: the API (create, list, change, revoke), the Keys page and its edit page, and
createapikey, all offering the same fields; and demoting a superuser (17 #10)."""
from __future__ import annotations

import json

import pytest
from django.core.management import call_command
from django.urls import reverse

from accounts.credentials import key_cache, lookup_key
from accounts.models import ApiKey, AuditEvent, User, hash_key
from tests.conftest import bearer

LIMITS = {"allowed_models": ["tiny", "embed"], "rpm": 3, "tpm": 1000, "daily_tokens": 5000,
          "monthly_tokens": 100000, "priority": 5}


def _json(client, method: str, path: str, key: str, body: dict | None = None):
    kwargs = {"content_type": "application/json", **bearer(key)}
    if body is not None:
        kwargs["data"] = json.dumps(body)
    return getattr(client, method)(path, **kwargs)


@pytest.mark.django_db
def test_an_admin_creates_a_key_with_limits_and_sees_it_once(client, admin, viewer):
    r = _json(client, "post", "/api/keys", admin.key, {"name": "team-a", "username": viewer.user.username,
                                                       "expires_in_days": 30, **LIMITS})
    assert r.status_code == 201, r.content
    body = r.json()
    raw = body["key"]
    assert raw.startswith("xgen_") and body["prefix"] == raw[:12] and body["username"] == viewer.user.username
    assert {k: body[k] for k in LIMITS} == {**LIMITS, "allowed_models": ["embed", "tiny"]}
    assert body["expires_at"] and body["active"] and body["last_used"] is None
    stored = ApiKey.objects.get(pk=body["id"])
    assert stored.key_hash == hash_key(raw) and stored.rpm == 3
    listing = _json(client, "get", "/api/keys", admin.key)
    assert listing.status_code == 200 and raw not in listing.content.decode()
    assert {k["name"] for k in listing.json()} >= {"team-a"}
    p = lookup_key(raw)
    assert p.rpm == 3 and p.allowed_models == frozenset({"tiny", "embed"})
    unlimited = _json(client, "post", "/api/keys", admin.key, {"name": "free", "username": viewer.user.username})
    assert unlimited.status_code == 201
    assert [unlimited.json()[k] for k in ("rpm", "tpm", "daily_tokens", "monthly_tokens")] == [None] * 4
    assert unlimited.json()["allowed_models"] == [] and unlimited.json()["priority"] == 4


@pytest.mark.django_db
@pytest.mark.parametrize("body, code", [
    ({"name": "x", "username": "nobody"}, 404),
    ({"name": "x", "username": "victor-viewer", "rpm": 0}, 400),
    ({"name": "x", "username": "victor-viewer", "priority": 10}, 400),
    ({"name": "x", "username": "victor-viewer", "allowed_models": "tiny"}, 400),
    ({"name": "", "username": "victor-viewer"}, 400),
])
def test_bad_key_requests_are_refused_in_openai_shape(client, admin, viewer, body, code):
    r = _json(client, "post", "/api/keys", admin.key, body)
    assert r.status_code == code, r.content
    assert set(r.json()["error"]) == {"message", "type", "code"}


@pytest.mark.django_db
def test_patch_changes_only_what_is_sent_and_takes_effect_at_once(client, admin, viewer):
    key = ApiKey.objects.get(user=viewer.user)
    assert lookup_key(viewer.key).rpm is None  # cached, unlimited
    r = _json(client, "patch", f"/api/keys/{key.pk}", admin.key, {"rpm": 10, "allowed_models": ["tiny"]})
    assert r.status_code == 200, r.content
    assert r.json()["rpm"] == 10 and r.json()["allowed_models"] == ["tiny"] and r.json()["name"] == key.name
    assert lookup_key(viewer.key).rpm == 10  # the cache forgot it in this process
    r = _json(client, "patch", f"/api/keys/{key.pk}", admin.key, {"rpm": None, "name": "renamed"})
    assert r.json()["rpm"] is None and r.json()["allowed_models"] == ["tiny"] and r.json()["name"] == "renamed"
    r = _json(client, "patch", f"/api/keys/{key.pk}", admin.key, {"expires_in_days": 1})
    assert r.json()["expires_at"] is not None
    r = _json(client, "patch", f"/api/keys/{key.pk}", admin.key, {"expires_in_days": None})
    assert r.json()["expires_at"] is None
    assert _json(client, "patch", "/api/keys/999999", admin.key, {"rpm": 1}).status_code == 404
    assert _json(client, "patch", f"/api/keys/{key.pk}", admin.key, {"tpm": -1}).status_code == 400


@pytest.mark.django_db
def test_delete_revokes_and_the_key_stops_at_once(client, admin, viewer):
    key = ApiKey.objects.get(user=viewer.user)
    assert client.get("/api/hardware/nodes", **bearer(viewer.key)).status_code == 200
    r = _json(client, "delete", f"/api/keys/{key.pk}", admin.key)
    assert r.status_code == 200 and r.json()["revoked_at"] and not r.json()["active"]
    assert client.get("/api/hardware/nodes", **bearer(viewer.key)).status_code == 401
    assert _json(client, "delete", f"/api/keys/{key.pk}", admin.key).status_code == 200  # idempotent
    assert ApiKey.objects.filter(pk=key.pk).exists()  # revoked, kept (usage and logs refer to it)


@pytest.mark.django_db
def test_only_admins_manage_keys(client, operator, viewer):
    for account in (operator, viewer):
        for method, path in (("get", "/api/keys"), ("post", "/api/keys"), ("patch", "/api/keys/1"),
                             ("delete", "/api/keys/1")):
            r = _json(client, method, path, account.key, {} if method in ("post", "patch") else None)
            assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_role", (method, path)


@pytest.mark.django_db
def test_the_keys_page_creates_and_edits_keys_with_the_same_fields(client, admin, viewer):
    client.force_login(admin.user)
    r = client.post(reverse("keys"), {"name": "paged", "user": viewer.user.pk, "allowed_models": "tiny, embed",
                                      "rpm": "3", "tpm": "", "daily_tokens": "100", "monthly_tokens": "",
                                      "priority": "2"}, follow=True)
    assert r.status_code == 200 and r.context["new_key"]
    key = ApiKey.objects.get(name="paged")
    assert (key.allowed_models, key.rpm, key.tpm, key.daily_tokens, key.priority) == (["embed", "tiny"], 3, None,
                                                                                      100, 2)
    page = client.get(reverse("keys")).content.decode()
    assert "3 rpm" in page and "100/day" in page and "embed, tiny" in page
    edit = client.get(reverse("key-edit", args=[key.pk]))
    assert edit.status_code == 200 and 'value="embed, tiny"' in edit.content.decode()
    r = client.post(reverse("key-edit", args=[key.pk]), {"name": "paged", "allowed_models": "", "rpm": "",
                                                          "tpm": "500", "daily_tokens": "", "monthly_tokens": "",
                                                          "priority": "0"})
    assert r.status_code == 302
    key.refresh_from_db()
    assert (key.allowed_models, key.rpm, key.tpm, key.daily_tokens) == ([], None, 500, None)
    bad = client.post(reverse("key-edit", args=[key.pk]), {"name": "paged", "rpm": "0", "priority": "0"})
    assert bad.status_code == 400 and "rpm" in bad.context["form"].errors


@pytest.mark.django_db
def test_createapikey_offers_the_same_fields(viewer, capsys):
    call_command("createapikey", "--username", viewer.user.username, "--name", "cli-limited", "--rpm", "3",
                 "--tpm", "1000", "--daily-tokens", "50", "--monthly-tokens", "500", "--allowed-models", "a,b",
                 "--priority", "1", "--expires-in-days", "7")
    raw = capsys.readouterr().out.strip()
    key = ApiKey.objects.get(key_hash=hash_key(raw))
    assert (key.rpm, key.tpm, key.daily_tokens, key.monthly_tokens, key.allowed_models, key.priority) == (
        3, 1000, 50, 500, ["a", "b"], 1)
    assert key.expires_at is not None
    assert AuditEvent.objects.filter(action="key_create", actor="cli").exists()


@pytest.mark.django_db
def test_demoting_a_superuser_on_the_users_page_takes_effect(client, admin):
    boss = User.objects.create_superuser("boss", "boss@example.org", "boss-pass-123")
    assert boss.role == "admin" and boss.has_role("admin")
    client.force_login(admin.user)
    r = client.get(reverse("user-edit", args=[boss.pk]))
    assert r.context["form"].initial["role"] == "admin"
    r = client.post(reverse("user-edit", args=[boss.pk]), {"role": "viewer", "is_active": "on"})
    assert r.status_code == 302
    boss.refresh_from_db()
    assert not boss.is_superuser and not boss.is_staff and boss.role == "viewer"
    assert not boss.has_role("operator")
    event = AuditEvent.objects.filter(action="user_change", target="boss").first()
    assert event.actor == admin.user.username and "is_superuser" in event.detail["changed"]


@pytest.mark.django_db
def test_demoting_an_old_superuser_with_a_viewer_role_takes_effect(client, admin):
    # A superuser made before 0.2 (createsuperuser) has role viewer and ranked as admin all the same.
    old = User.objects.create_user("legacy", password="legacy-pass-123", is_superuser=True, is_staff=True)
    key_cache.clear()
    assert old.has_role("admin")
    client.force_login(admin.user)
    client.post(reverse("user-edit", args=[old.pk]), {"role": "viewer", "is_active": "on"})
    old.refresh_from_db()
    assert not old.has_role("admin") and not old.is_superuser
