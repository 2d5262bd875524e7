"""Admin pages: users (create, edit role, activate, reset password), API keys (create with limits,
edit limits, revoke) and the audit log."""
from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.forms import PasswordChangeForm
from django.contrib.auth.views import LoginView, PasswordChangeView
from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse_lazy
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from accounts.audit import ACTIONS, record_audit
from accounts.auth import role_required
from accounts.credentials import notify_changed
from accounts.forms import ApiKeyCreateForm, ApiKeyEditForm, UserCreateForm, UserEditForm
from accounts.models import ApiKey, AuditEvent, AuditOutcome, Role, User
from accounts.query import query_int
from accounts.services import (
    create_api_key,
    create_user,
    expiry_in,
    revoke_api_key,
    set_key_team,
    update_api_key,
    update_user,
)
from accounts.sso import sso_context

AUDIT_PAGE_SIZE = 100


class SignIn(LoginView):
    """Django's sign-in page that first asks the database: while it is away the page says so
    (503, xgenconsole.views.server_error) instead of a form that could only fail."""

    template_name = "accounts/login.html"
    redirect_authenticated_user = True

    def get(self, request: HttpRequest, *args, **kwargs) -> HttpResponse:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return super().get(request, *args, **kwargs)

    def get_context_data(self, **kwargs):
        from accounts import oidc

        context = super().get_context_data(**kwargs)
        context.update(sso_context(self.request))
        context["oidc_enabled"] = oidc.enabled()
        return context


class PasswordChange(PasswordChangeView):
    """Any signed-in user changes their own password (the old one first; Django's validators on the
    new one); the session stays signed in, the change is audited."""

    template_name = "accounts/password_change.html"
    success_url = reverse_lazy("home")

    def form_valid(self, form: PasswordChangeForm) -> HttpResponse:
        response = super().form_valid(form)
        notify_changed("sessions")  # the user's other sessions end (Django's session hash), the proxy's too
        record_audit(action="password_change", target=self.request.user.get_username(), request=self.request)
        messages.success(self.request, "Your password is changed.")
        return response

    def form_invalid(self, form: PasswordChangeForm) -> HttpResponse:
        record_audit(action="password_change", target=self.request.user.get_username(), request=self.request,
                     outcome=AuditOutcome.REFUSED, detail={"errors": sorted(form.errors)})
        return super().form_invalid(form)


@role_required(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def users_page(request: HttpRequest) -> HttpResponse:
    form = UserCreateForm(request.POST or None)
    if request.method == "POST":
        if form.is_valid():
            user = create_user(
                username=form.cleaned_data["username"],
                role=form.cleaned_data["role"],
                password=form.cleaned_data["password"],
            )
            record_audit(action="user_create", target=user.username, request=request, detail={"role": user.role})
            messages.success(request, f"User {user.username} created as {user.role}.")
            return redirect("users")
        record_audit(action="user_create", target=request.POST.get("username", ""), request=request,
                     outcome=AuditOutcome.REFUSED, detail={"errors": sorted(form.errors)})
    users = User.objects.order_by("username")
    return render(request, "accounts/users.html", {"form": form, "users": users})


@role_required(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def user_edit(request: HttpRequest, user_id: int) -> HttpResponse:
    target = get_object_or_404(User, pk=user_id)
    shown_role = Role.ADMIN if target.is_superuser else target.role
    form = UserEditForm(request.POST or None, initial={"role": shown_role, "is_active": target.is_active}, user=target)
    if request.method == "POST" and form.is_valid():
        if target == request.user and (form.cleaned_data["role"] != Role.ADMIN or not form.cleaned_data["is_active"]):
            record_audit(action="user_change", target=target.username, request=request,
                         outcome=AuditOutcome.REFUSED, detail={"reason": "self-demotion"})
            messages.error(request, "You cannot demote or deactivate yourself.")
            return redirect("user-edit", user_id=target.pk)
        if target.idp_source and form.cleaned_data["new_password"]:
            record_audit(action="user_change", target=target.username, request=request,
                         outcome=AuditOutcome.REFUSED, detail={"reason": "password for an SSO user"})
            messages.error(request, f"{target.username} signs in with {target.get_idp_source_display()}: "
                                    f"no password can be set here.")
            return redirect("user-edit", user_id=target.pk)
        changed = update_user(user=target, role=form.cleaned_data["role"], is_active=form.cleaned_data["is_active"],
                              new_password=form.cleaned_data["new_password"])
        record_audit(action="user_change", target=target.username, request=request,
                     detail={"changed": changed, "role": target.role, "is_active": target.is_active})
        messages.success(request, f"User {target.username} saved.")
        return redirect("users")
    return render(request, "accounts/user_edit.html", {"form": form, "target": target})


@role_required(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def keys_page(request: HttpRequest) -> HttpResponse:
    form = ApiKeyCreateForm(request.POST or None, initial={"user": request.user})
    if request.method == "POST":
        if form.is_valid():
            owner = form.cleaned_data["user"]
            key, raw = create_api_key(user=owner, name=form.cleaned_data["name"],
                                      expires_at=expiry_in(form.cleaned_data.get("expires_in_days")),
                                      team=form.cleaned_data.get("team"), **form.limits())
            record_audit(action="key_create", target=f"key {key.pk} ({key.name})", request=request,
                         detail={"user": owner.username, **_limits_detail(key)})
            # Post/Redirect/Get: the raw key rides in the session for exactly one page view.
            request.session["new_api_key"] = raw
            messages.success(request, f"Key {key.name} created. Copy it now: it is not shown again.")
            return redirect("keys")
        record_audit(action="key_create", target=request.POST.get("name", ""), request=request,
                     outcome=AuditOutcome.REFUSED, detail={"errors": sorted(form.errors)})
    new_key = request.session.pop("new_api_key", None)
    keys = ApiKey.objects.select_related("user", "team").all()
    response = render(request, "accounts/keys.html", {"form": form, "keys": keys, "new_key": new_key})
    if new_key:
        response["Cache-Control"] = "no-store"
    return response


def _limits_detail(key: ApiKey) -> dict:
    return {"allowed_models": list(key.allowed_models or []), "rpm": key.rpm, "tpm": key.tpm,
            "daily_tokens": key.daily_tokens, "monthly_tokens": key.monthly_tokens, "priority": key.priority,
            "scopes": list(key.scopes or []), "team": key.team.slug if key.team else None}


@role_required(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def key_edit(request: HttpRequest, key_id: int) -> HttpResponse:
    key = get_object_or_404(ApiKey.objects.select_related("user", "team"), pk=key_id)
    initial = {"name": key.name, "allowed_models": ", ".join(key.allowed_models or []), "rpm": key.rpm,
               "tpm": key.tpm, "daily_tokens": key.daily_tokens, "monthly_tokens": key.monthly_tokens,
               "priority": key.priority, "scopes": list(key.scopes or []), "team": key.team_id}
    form = ApiKeyEditForm(request.POST or None, initial=initial)
    if request.method == "POST":
        if form.is_valid():
            changed = update_api_key(key=key, name=form.cleaned_data["name"], **form.limits())
            if set_key_team(key=key, team=form.cleaned_data.get("team")):
                changed.append("team")
            record_audit(action="key_change", target=f"key {key.pk} ({key.name})", request=request,
                         detail={"changed": changed, **_limits_detail(key)})
            messages.success(request, f"Key {key.name} saved." if changed else f"Key {key.name}: nothing changed.")
            return redirect("keys")
        record_audit(action="key_change", target=f"key {key.pk} ({key.name})", request=request,
                     outcome=AuditOutcome.REFUSED, detail={"errors": sorted(form.errors)})
    return render(request, "accounts/key_edit.html", {"form": form, "key": key},
                  status=400 if request.method == "POST" else 200)


@role_required(Role.ADMIN)
@require_POST
def key_revoke(request: HttpRequest, key_id: int) -> HttpResponse:
    key = get_object_or_404(ApiKey, pk=key_id)
    revoke_api_key(key=key)
    record_audit(action="key_revoke", target=f"key {key.pk} ({key.name})", request=request)
    messages.success(request, f"Key {key.name} revoked.")
    return redirect("keys")


@role_required(Role.ADMIN)
@require_GET
def audit_page(request: HttpRequest) -> HttpResponse:
    """Every change and sign-in, newest first; filters by actor, action and outcome; older pages by id."""
    actor = request.GET.get("actor", "").strip()[:150]
    action = request.GET.get("action", "").strip()[:32]
    outcome = request.GET.get("outcome", "").strip()[:16]
    before = query_int(request.GET, "before", minimum=1)
    rows = AuditEvent.objects.all()
    if actor:
        rows = rows.filter(actor=actor)
    if action:
        rows = rows.filter(action=action)
    if outcome:
        rows = rows.filter(outcome=outcome)
    if before is not None:
        rows = rows.filter(pk__lt=before)
    page = list(rows.order_by("-pk")[: AUDIT_PAGE_SIZE + 1])
    older = page[AUDIT_PAGE_SIZE - 1].pk if len(page) > AUDIT_PAGE_SIZE else None
    ctx = {"events": page[:AUDIT_PAGE_SIZE], "older": older, "actor": actor, "action": action, "outcome": outcome,
           "actions": ACTIONS, "outcomes": AuditOutcome.values}
    template = "accounts/partials/_audit_rows.html" if request.htmx else "accounts/audit.html"
    return render(request, template, ctx)
