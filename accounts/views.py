"""Admin pages: users (create, edit role, activate, reset password) and API keys (create, revoke)."""
from __future__ import annotations

from datetime import timedelta

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from accounts.auth import role_required
from accounts.credentials import key_cache
from accounts.forms import ApiKeyCreateForm, UserCreateForm, UserEditForm
from accounts.models import ApiKey, Role, User
from accounts.services import create_api_key, create_user, revoke_api_key


@role_required(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def users_page(request: HttpRequest) -> HttpResponse:
    form = UserCreateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        user = create_user(
            username=form.cleaned_data["username"],
            role=form.cleaned_data["role"],
            password=form.cleaned_data["password"],
        )
        messages.success(request, f"User {user.username} created as {user.role}.")
        return redirect("users")
    users = User.objects.order_by("username")
    return render(request, "accounts/users.html", {"form": form, "users": users})


@role_required(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def user_edit(request: HttpRequest, user_id: int) -> HttpResponse:
    target = get_object_or_404(User, pk=user_id)
    form = UserEditForm(request.POST or None, initial={"role": target.role, "is_active": target.is_active})
    if request.method == "POST" and form.is_valid():
        if target == request.user and (form.cleaned_data["role"] != Role.ADMIN or not form.cleaned_data["is_active"]):
            messages.error(request, "You cannot demote or deactivate yourself.")
            return redirect("user-edit", user_id=target.pk)
        target.role = form.cleaned_data["role"]
        target.is_staff = target.role == Role.ADMIN
        target.is_active = form.cleaned_data["is_active"]
        if form.cleaned_data["new_password"]:
            target.set_password(form.cleaned_data["new_password"])
        target.save()
        key_cache.clear()
        messages.success(request, f"User {target.username} saved.")
        return redirect("users")
    return render(request, "accounts/user_edit.html", {"form": form, "target": target})


@role_required(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def keys_page(request: HttpRequest) -> HttpResponse:
    form = ApiKeyCreateForm(request.POST or None, initial={"user": request.user})
    if request.method == "POST" and form.is_valid():
        days = form.cleaned_data.get("expires_in_days")
        expires = timezone.now() + timedelta(days=days) if days else None
        key, raw = create_api_key(user=form.cleaned_data["user"], name=form.cleaned_data["name"], expires_at=expires)
        # Post/Redirect/Get: the raw key rides in the session for exactly one page view.
        request.session["new_api_key"] = raw
        messages.success(request, f"Key {key.name} created. Copy it now: it is not shown again.")
        return redirect("keys")
    new_key = request.session.pop("new_api_key", None)
    keys = ApiKey.objects.select_related("user").all()
    response = render(request, "accounts/keys.html", {"form": form, "keys": keys, "new_key": new_key})
    if new_key:
        response["Cache-Control"] = "no-store"
    return response


@role_required(Role.ADMIN)
@require_POST
def key_revoke(request: HttpRequest, key_id: int) -> HttpResponse:
    key = get_object_or_404(ApiKey, pk=key_id)
    revoke_api_key(key=key)
    messages.success(request, f"Key {key.name} revoked.")
    return redirect("keys")
