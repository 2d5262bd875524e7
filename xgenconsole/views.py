"""Project-level pages: home, health, users and API keys (admins)."""
from __future__ import annotations

import uuid
from datetime import timedelta

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.contrib import messages
from django.contrib.auth.decorators import login_not_required
from django.core.exceptions import PermissionDenied
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods, require_POST

from accounts.errors import json_error
from hardware.models import Node
from xgenconsole.forms import ApiKeyCreateForm, UserCreateForm, UserEditForm
from xgenconsole.models import ApiKey, Role, User
from xgenconsole.services import create_api_key, create_user, revoke_api_key


def role_required(role: str):
    """Page decorator: the signed-in user needs `role` or above, else 403."""

    def decorator(view):
        def wrapped(request: HttpRequest, *args, **kwargs):
            if not request.user.has_role(role):
                raise PermissionDenied(f"This page needs the {role} role.")
            return view(request, *args, **kwargs)

        wrapped.__name__ = view.__name__
        wrapped.__doc__ = view.__doc__
        wrapped.required_role = role  # read by the auth matrix test
        return wrapped

    return decorator


def home(request: HttpRequest) -> HttpResponse:
    return redirect("instances")


@login_not_required
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def _check_database() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # any driver error means not ready
        return f"database: {exc.__class__.__name__}: {exc}"
    return None


def _fresh_node_names() -> list[str]:
    return list(Node.fresh().values_list("name", flat=True))


@login_not_required
async def readyz(request: HttpRequest) -> JsonResponse:
    reasons: list[str] = []
    db_error = await sync_to_async(_check_database)()
    if db_error:
        reasons.append(db_error)
    try:
        layer = get_channel_layer()
        channel = await layer.new_channel("readyz.")
        token = uuid.uuid4().hex
        await layer.send(channel, {"type": "readyz.ping", "token": token})
        message = await layer.receive(channel)
        if message.get("token") != token:
            reasons.append("channel layer: a different message came back")
    except Exception as exc:
        reasons.append(f"channel layer: {exc.__class__.__name__}: {exc}")
    nodes: list[str] = []
    if not db_error:
        nodes = await sync_to_async(_fresh_node_names)()
        if not nodes:
            reasons.append("no node agent has a fresh heartbeat")
    if reasons:
        return JsonResponse({"status": "not ready", "reasons": reasons}, status=503)
    return JsonResponse({"status": "ready", "nodes": nodes})


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
    return render(request, "xgenconsole/users.html", {"form": form, "users": users})


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
        from xgenconsole.auth import key_cache

        key_cache.clear()
        messages.success(request, f"User {target.username} saved.")
        return redirect("users")
    return render(request, "xgenconsole/user_edit.html", {"form": form, "target": target})


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
    response = render(request, "xgenconsole/keys.html", {"form": form, "keys": keys, "new_key": new_key})
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


@csrf_exempt  # unknown API paths answer JSON 404 whatever the method, never Django's HTML 403
@login_not_required
def api_not_found(request: HttpRequest) -> JsonResponse:
    return json_error(404, f"No API route at {request.path}.", code="not_found")


@login_not_required
def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if request.path.startswith(("/api/", "/v1/")):
        return json_error(404, f"No route at {request.path}.", code="not_found")
    return render(request, "404.html", status=404)


@login_not_required
def server_error(request: HttpRequest) -> HttpResponse:
    if request.path.startswith(("/api/", "/v1/")):
        return json_error(500, "Internal error; the server log has the details.", code="internal_error")
    return render(request, "500.html", status=500)
