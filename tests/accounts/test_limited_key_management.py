"""A key with limits cannot lift them (issue 23, item 3): through the keys API it can neither
change itself nor make or change another key (which could be unlimited), whatever its user's
role; it may revoke itself. An unlimited admin key and the Keys page keep managing keys."""
from __future__ import annotations

import pytest
from django.test import Client

from accounts.models import ApiKey, AuditEvent
from accounts.services import create_api_key
from tests.conftest import bearer

pytestmark = pytest.mark.django_db


def _limited(admin, **limits) -> tuple[ApiKey, str]:
    return create_api_key(user=admin.user, name="script", **limits)


@pytest.mark.parametrize("limits", [{"allowed_models": ["small"]}, {"rpm": 5}, {"tpm": 100},
                                    {"daily_tokens": 1000}, {"monthly_tokens": 10**6}])
def test_a_limited_admin_key_cannot_raise_its_own_limits(admin, limits):
    key, raw = _limited(admin, **limits)
    client = Client()
    lifted = {field: ([] if field == "allowed_models" else None) for field in limits}
    r = client.patch(f"/api/keys/{key.pk}", lifted, content_type="application/json", **bearer(raw))
    assert r.status_code == 403, r.content
    assert r.json()["error"]["code"] == "limited_key"
    key.refresh_from_db()
    assert (key.allowed_models or None, key.rpm, key.tpm, key.daily_tokens, key.monthly_tokens) != (
        None, None, None, None, None), "the limit stayed"
    refused = AuditEvent.objects.filter(action="key_change", outcome="refused").first()
    assert refused is not None and refused.detail["key_id"] == key.pk


def test_a_limited_admin_key_cannot_make_an_unlimited_key_or_touch_others(admin, viewer):
    key, raw = _limited(admin, rpm=5)
    client = Client()
    before = ApiKey.objects.count()
    r = client.post("/api/keys", {"name": "free", "username": admin.user.username},
                    content_type="application/json", **bearer(raw))
    assert r.status_code == 403 and r.json()["error"]["code"] == "limited_key", r.content
    assert ApiKey.objects.count() == before
    other = ApiKey.objects.get(user=viewer.user)
    r = client.patch(f"/api/keys/{other.pk}", {"rpm": None}, content_type="application/json", **bearer(raw))
    assert r.status_code == 403, r.content
    r = client.delete(f"/api/keys/{other.pk}", **bearer(raw))
    assert r.status_code == 403, r.content
    other.refresh_from_db()
    assert other.revoked_at is None
    # It may revoke itself (a leaked key's holder can end it).
    r = client.delete(f"/api/keys/{key.pk}", **bearer(raw))
    assert r.status_code == 200 and r.json()["active"] is False, r.content


def test_an_unlimited_admin_key_still_manages_keys(admin, viewer):
    client = Client()
    r = client.post("/api/keys", {"name": "ci", "username": viewer.user.username, "rpm": 10},
                    content_type="application/json", **bearer(admin.key))
    assert r.status_code == 201, r.content
    r = client.patch(f"/api/keys/{r.json()['id']}", {"rpm": 20}, content_type="application/json",
                     **bearer(admin.key))
    assert r.status_code == 200 and r.json()["rpm"] == 20, r.content


def test_a_signed_in_admin_manages_keys_whatever_their_keys_hold(admin):
    key, _ = _limited(admin, rpm=5)
    client = Client()
    client.force_login(admin.user)
    r = client.patch(f"/api/keys/{key.pk}", {"rpm": None}, content_type="application/json")
    assert r.status_code == 200 and r.json()["rpm"] is None, r.content
