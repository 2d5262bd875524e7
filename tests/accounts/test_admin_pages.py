import pytest
from django.urls import reverse

from accounts.models import ApiKey, User, hash_key


@pytest.mark.django_db
def test_admin_creates_a_key_shown_once(client, admin, viewer):
    client.force_login(admin.user)
    response = client.post(reverse("keys"), {"name": "ci", "user": viewer.user.pk}, follow=True)
    assert response.status_code == 200
    raw = response.context["new_key"]
    assert raw.startswith("xgen_") and raw.encode() in response.content
    key = ApiKey.objects.get(name="ci")
    assert key.key_hash == hash_key(raw) and raw not in key.prefix + key.key_hash
    assert response["Cache-Control"] == "no-store"
    listing = client.get(reverse("keys"))
    assert raw.encode() not in listing.content
    assert key.prefix.encode() in listing.content


@pytest.mark.django_db
def test_admin_creates_and_edits_users(client, admin):
    client.force_login(admin.user)
    response = client.post(reverse("users"), {"username": "newbie", "role": "operator", "password": "s3cret-pass-1"})
    assert response.status_code == 302
    newbie = User.objects.get(username="newbie")
    assert newbie.role == "operator" and newbie.check_password("s3cret-pass-1")
    response = client.post(reverse("user-edit", args=[newbie.pk]), {"role": "viewer", "is_active": ""})
    newbie.refresh_from_db()
    assert (newbie.role, newbie.is_active) == ("viewer", False)


@pytest.mark.django_db
def test_bad_user_form_shows_errors(client, admin):
    client.force_login(admin.user)
    response = client.post(reverse("users"), {"username": "bad name!", "role": "root", "password": "x"})
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert {"username", "role", "password"} <= set(errors)


@pytest.mark.django_db
def test_admin_cannot_demote_themselves(client, admin):
    client.force_login(admin.user)
    client.post(reverse("user-edit", args=[admin.user.pk]), {"role": "viewer", "is_active": "on"})
    admin.user.refresh_from_db()
    assert admin.user.role == "admin"
