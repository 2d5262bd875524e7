"""The audit log: sign-ins (success and refusal), sign-outs, key and user changes from the pages
and the API, each with its actor, target, outcome and client; append-only; read by admins only."""
from __future__ import annotations

import json

import pytest
from django.test import Client
from django.urls import reverse

from accounts.audit import record_audit
from accounts.models import ApiKey, AuditEvent, User
from tests.conftest import bearer

pytestmark = pytest.mark.django_db


def events(action: str) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action=action).order_by("pk"))


def test_sign_ins_succeeded_and_refused_and_sign_outs(admin):
    c = Client(REMOTE_ADDR="10.1.2.3")
    assert c.post(reverse("login"), {"username": admin.user.username, "password": "wrong"}).status_code == 200
    assert c.post(reverse("login"), {"username": "mallory", "password": "x"}).status_code == 200
    assert c.post(reverse("login"), {"username": admin.user.username, "password": admin.password}).status_code == 302
    c.post(reverse("logout"))
    failed = events("login_failed")
    assert [(e.actor, e.outcome, e.client) for e in failed] == [
        (admin.user.username, "refused", "10.1.2.3"), ("mallory", "refused", "10.1.2.3")]
    assert all("password" not in json.dumps(e.detail) and "wrong" not in json.dumps(e.detail) for e in failed)
    (login,) = events("login")
    assert (login.actor, login.actor_id, login.outcome, login.client) == (admin.user.username, admin.user.pk,
                                                                          "success", "10.1.2.3")
    assert events("logout")[0].actor == admin.user.username


def test_key_and_user_changes_from_the_pages(admin, viewer):
    c = Client(REMOTE_ADDR="10.0.0.9")
    c.force_login(admin.user)
    c.post(reverse("users"), {"username": "newbie", "role": "operator", "password": "s3cret-pass-1"})
    c.post(reverse("users"), {"username": "bad name!", "role": "root", "password": "x"})
    newbie = User.objects.get(username="newbie")
    c.post(reverse("user-edit", args=[newbie.pk]), {"role": "viewer", "is_active": "on"})
    c.post(reverse("keys"), {"name": "k1", "user": viewer.user.pk, "rpm": "5", "priority": "0"})
    key = ApiKey.objects.get(name="k1")
    c.post(reverse("key-edit", args=[key.pk]), {"name": "k1", "rpm": "6", "priority": "0"})
    c.post(reverse("key-revoke", args=[key.pk]))
    created, refused = events("user_create")
    assert (created.actor, created.target, created.outcome, created.client) == (admin.user.username, "newbie",
                                                                                 "success", "10.0.0.9")
    assert refused.outcome == "refused" and refused.detail["via"] == "page"
    (changed,) = events("user_change")
    assert changed.detail["changed"] == ["role"] and changed.actor == admin.user.username
    (made,) = events("key_create")
    assert made.target == f"key {key.pk} (k1)" and made.detail["rpm"] == 5 and made.detail["user"] == "victor-viewer"
    (edit,) = events("key_change")
    assert edit.detail["changed"] == ["rpm"] and edit.actor == admin.user.username
    (revoke,) = events("key_revoke")
    assert (revoke.actor, revoke.target, revoke.outcome) == (admin.user.username, f"key {key.pk} (k1)", "success")


def test_key_changes_from_the_api_name_the_actor_and_its_key(admin, viewer):
    c = Client(REMOTE_ADDR="10.0.0.7")
    admin_key = ApiKey.objects.get(user=admin.user)
    r = c.post("/api/keys", json.dumps({"name": "api-k", "username": viewer.user.username, "tpm": 100}),
               content_type="application/json", **bearer(admin.key))
    kid = r.json()["id"]
    c.patch(f"/api/keys/{kid}", json.dumps({"tpm": 200}), content_type="application/json", **bearer(admin.key))
    c.delete(f"/api/keys/{kid}", **bearer(admin.key))
    c.post("/api/keys", json.dumps({"name": "x", "username": "ghost"}), content_type="application/json",
           **bearer(admin.key))
    rows = list(AuditEvent.objects.filter(action__startswith="key_").order_by("pk"))
    assert [(e.action, e.outcome) for e in rows] == [("key_create", "success"), ("key_change", "success"),
                                                     ("key_revoke", "success"), ("key_create", "refused")]
    for e in rows:
        assert e.actor == admin.user.username and e.client == "10.0.0.7"
        assert e.detail["via"] == "api" and e.detail["key_id"] == admin_key.pk


def test_the_log_is_append_only_and_no_route_changes_it(admin):
    event = record_audit(action="load", actor="someone", target="x")
    event.target = "changed"
    with pytest.raises(PermissionError):
        event.save()
    with pytest.raises(PermissionError):
        event.delete()
    from xgenconsole.api import api

    audit_paths = {p: set(ops) for p, ops in api.get_openapi_schema()["paths"].items() if p.startswith("/api/audit")}
    assert audit_paths == {"/api/audit": {"get"}}


def test_the_api_filters_and_is_for_admins(admin, operator):
    record_audit(action="load", actor="olga-operator", target="a")
    record_audit(action="unload", actor="olga-operator", target="b", outcome="refused")
    record_audit(action="load", actor="someone-else", target="c")
    c = Client()
    r = c.get("/api/audit?actor=olga-operator&action=load", **bearer(admin.key))
    assert r.status_code == 200
    assert [(i["actor"], i["action"], i["target"]) for i in r.json()["items"]] == [("olga-operator", "load", "a")]
    assert set(r.json()["items"][0]) >= {"time", "actor", "action", "target", "outcome", "client", "detail"}
    assert [i["target"] for i in c.get("/api/audit?limit=2", **bearer(admin.key)).json()["items"]] == ["c", "b"]
    assert c.get("/api/audit", **bearer(operator.key)).status_code == 403


def test_the_audit_page_filters_for_admins_only(admin, operator):
    record_audit(action="load", actor="olga-operator", target="model-a")
    record_audit(action="key_revoke", actor="alice-admin", target="key 9")
    c = Client()
    c.force_login(operator.user)
    assert c.get(reverse("audit")).status_code == 403
    c.force_login(admin.user)
    page = c.get(reverse("audit"), {"action": "load"}).content.decode()
    assert "model-a" in page and "key 9" not in page
    partial = c.get(reverse("audit"), {"actor": "alice-admin"}, HTTP_HX_REQUEST="true").content.decode()
    assert "key 9" in partial and "<html" not in partial
