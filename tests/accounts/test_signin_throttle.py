"""Sign-in is throttled per user name and per client address (django-axes, issue 34 #21): after
10 failures in a row the sign-in page answers 429 for the cool-off, even to the right password,
and says why; a lockout is in the audit log. A successful sign-in clears that user name's count,
never the address's."""
from __future__ import annotations

import time

import pytest
from django.test import Client
from django.urls import reverse

from accounts.models import AuditEvent

pytestmark = pytest.mark.django_db
LIMIT = 10


def _sign_in(address: str, username: str, password: str) -> int:
    return Client(REMOTE_ADDR=address).post(reverse("login"), {"username": username, "password": password}).status_code


def test_ten_wrong_passwords_then_the_right_one_is_refused(admin):
    name = admin.user.username
    assert [_sign_in("10.0.0.1", name, f"wrong-{i}") for i in range(LIMIT - 1)] == [200] * (LIMIT - 1)
    assert _sign_in("10.0.0.1", name, "wrong-last") == 429
    response = Client(REMOTE_ADDR="10.0.0.1").post(reverse("login"), {"username": name, "password": admin.password})
    assert response.status_code == 429 and b"sign-in is paused for 15 minutes" in response.content
    assert response["Retry-After"] == "900"
    assert _sign_in("10.9.9.9", name, admin.password) == 429  # the user name is locked from any address
    locked = AuditEvent.objects.filter(action="login_locked")
    assert locked.exists() and {e.target for e in locked} == {name}
    assert all(e.outcome == "refused" for e in locked)
    assert AuditEvent.objects.filter(action="login_failed", target=name).count() >= LIMIT


def test_one_address_trying_many_names_is_locked_out(admin, viewer):
    for i in range(LIMIT):
        _sign_in("10.0.0.2", f"guess-{i}", "password")
    assert _sign_in("10.0.0.2", viewer.user.username, viewer.password) == 429
    assert _sign_in("10.0.0.3", viewer.user.username, viewer.password) == 302  # from elsewhere: fine


def test_failures_count_in_a_row_for_the_user_name(admin):
    name = admin.user.username
    for _ in range(3):
        assert [_sign_in(f"10.1.0.{i}", name, "nope") for i in range(LIMIT - 1)] == [200] * (LIMIT - 1)
        assert _sign_in("10.1.1.1", name, admin.password) == 302  # resets this name's count


def test_signing_in_to_ones_own_account_does_not_reset_the_address(admin, viewer):
    victim, own = admin.user.username, viewer
    for _ in range(LIMIT - 1):
        _sign_in("10.0.0.4", victim, "guess")
    assert _sign_in("10.0.0.4", own.user.username, own.password) == 302
    assert _sign_in("10.0.0.4", victim, "guess") == 429  # the tenth failure from this address
    assert _sign_in("10.0.0.4", own.user.username, own.password) == 429


def test_the_cooloff_ends(admin, settings):
    from datetime import timedelta

    settings.AXES_COOLOFF_TIME = timedelta(seconds=1)
    for _ in range(LIMIT):
        _sign_in("10.0.0.5", admin.user.username, "wrong")
    assert _sign_in("10.0.0.5", admin.user.username, admin.password) == 429
    time.sleep(1.5)
    assert _sign_in("10.0.0.5", admin.user.username, admin.password) == 302


def test_tries_during_a_lockout_add_no_rows(admin):
    from axes.models import AccessAttempt

    for i in range(LIMIT):
        _sign_in("10.0.0.6", f"name-{i}", "wrong")
    rows = AccessAttempt.objects.count()
    for i in range(20):  # new names each time, as a client filling the table would send
        assert _sign_in("10.0.0.6", f"more-{i}", "wrong") == 429
    assert AccessAttempt.objects.count() == rows


def test_a_password_checked_without_a_request_still_works(admin):
    """A shell or a script (no request) checks a password as before: the throttle is the sign-in page's."""
    from django.contrib.auth import authenticate

    assert authenticate(username=admin.user.username, password=admin.password) == admin.user
    assert authenticate(username=admin.user.username, password="wrong") is None
