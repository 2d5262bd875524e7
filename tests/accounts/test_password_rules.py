"""Django's password validators (common, all-numeric, similar to the user name, a minimum length)
hold wherever the console sets a password: createuser, the Users page's create and reset
(issue 34 #21: "password" and "12345678" were accepted)."""
from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse

from accounts.models import User

pytestmark = pytest.mark.django_db

WEAK = ["password", "12345678", "87654321098", "short7!", "newbie-newbie"]


@pytest.mark.parametrize("password", WEAK)
def test_createuser_refuses_a_weak_password(password):
    with pytest.raises(CommandError):
        call_command("createuser", "--username", "newbie-newbie", "--role", "viewer", "--password", password)
    assert not User.objects.filter(username="newbie-newbie").exists()


@pytest.mark.parametrize("password", WEAK)
def test_the_users_page_refuses_a_weak_password_on_create(admin, password):
    client = Client()
    client.force_login(admin.user)
    response = client.post(reverse("users"), {"username": "newbie-newbie", "role": "viewer", "password": password})
    assert response.status_code == 200 and "password" in response.context["form"].errors
    assert not User.objects.filter(username="newbie-newbie").exists()


@pytest.mark.parametrize("password", ["password", "12345678", "victor-viewer1"])
def test_a_reset_on_the_users_page_refuses_a_weak_password(admin, viewer, password):
    client = Client()
    client.force_login(admin.user)
    response = client.post(reverse("user-edit", args=[viewer.user.pk]),
                           {"role": "viewer", "is_active": "on", "new_password": password})
    assert response.status_code == 200 and "new_password" in response.context["form"].errors
    viewer.user.refresh_from_db()
    assert viewer.user.check_password(viewer.password)


def test_a_strong_password_is_taken_everywhere(admin, viewer):
    call_command("createuser", "--username", "ops", "--role", "operator", "--password", "Tangerine-Harbour-42")
    client = Client()
    client.force_login(admin.user)
    assert client.post(reverse("users"), {"username": "newbie", "role": "viewer",
                                          "password": "Quiet-Lantern-907"}).status_code == 302
    assert client.post(reverse("user-edit", args=[viewer.user.pk]),
                       {"role": "viewer", "is_active": "on", "new_password": "Copper-Meadow-318"}).status_code == 302
    viewer.user.refresh_from_db()
    assert viewer.user.check_password("Copper-Meadow-318")


@pytest.mark.parametrize("password", ["password", "12345678", "victor-viewer-1"])
def test_changing_ones_own_password_refuses_a_weak_one(viewer, password):
    client = Client()
    client.force_login(viewer.user)
    response = client.post(reverse("password-change"), {"old_password": viewer.password, "new_password1": password,
                                                        "new_password2": password})
    assert response.status_code == 200 and "new_password2" in response.context["form"].errors
    viewer.user.refresh_from_db()
    assert viewer.user.check_password(viewer.password)


def test_changing_ones_own_password(viewer):
    from accounts.models import AuditEvent

    client = Client()
    client.force_login(viewer.user)
    assert client.get(reverse("password-change")).status_code == 200
    response = client.post(reverse("password-change"), {"old_password": viewer.password,
                                                        "new_password1": "Velvet-Orchard-552",
                                                        "new_password2": "Velvet-Orchard-552"})
    assert response.status_code == 302
    viewer.user.refresh_from_db()
    assert viewer.user.check_password("Velvet-Orchard-552")
    assert client.get("/instances/").status_code == 200  # still signed in
    assert AuditEvent.objects.filter(action="password_change", target=viewer.user.username,
                                     outcome="success").exists()
    assert Client().get(reverse("password-change")).status_code == 302  # anonymous: to the login page
