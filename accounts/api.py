"""The keys API (admin; mounted at /api/keys) and the audit log API (admin; /api/audit)."""
from __future__ import annotations

from django.http import HttpRequest
from ninja import Field as NinjaField
from ninja import Query, Router, Schema, Status

from accounts.audit import record_audit
from accounts.auth import admin_auth, require_role
from accounts.errors import ApiError
from accounts.models import KEY_SCOPES, ApiKey, AuditEvent, AuditOutcome, User
from accounts.schemas import AuditPage, KeyCreatedOut, KeyIn, KeyOut, KeyPatch
from accounts.services import KeyInputError, create_api_key, expiry_in, revoke_api_key, update_api_key

keys_router = Router()
audit_router = Router()

LIMITS = ("allowed_models", "rpm", "tpm", "daily_tokens", "monthly_tokens", "priority", "scopes")


def key_out(key: ApiKey) -> dict:
    return {
        "id": key.pk, "name": key.name, "prefix": key.prefix, "username": key.user.username,
        "role": "admin" if key.user.is_superuser else key.user.role, "created_at": key.created_at,
        "last_used": key.last_used_at, "expires_at": key.expires_at, "revoked_at": key.revoked_at,
        "active": key.is_usable, "allowed_models": list(key.allowed_models or []), "rpm": key.rpm, "tpm": key.tpm,
        "daily_tokens": key.daily_tokens, "monthly_tokens": key.monthly_tokens, "priority": key.priority,
        "scopes": list(key.scopes or []),
    }


def _unlimited_key_only(request: HttpRequest, action: str, target: str) -> None:
    """Keys are made and changed by the console's people, or by an unlimited admin key: a key with
    limits (allowed_models, rpm, tpm, token quotas) could otherwise lift them, by changing itself or
    by making a key without them, so its holder would be bounded only by what they ask (issue 23)."""
    key_id = getattr(request, "api_key_id", None)
    if not key_id:
        return
    own = ApiKey.objects.filter(pk=key_id).first()
    if own is not None and (own.allowed_models or own.is_limited):
        record_audit(action=action, target=target, request=request, outcome=AuditOutcome.REFUSED,
                     detail={"reason": "a key with limits cannot manage keys"})
        raise ApiError(403, "This API key has limits (allowed_models, rpm, tpm or token quotas), so it cannot "
                            "create, change or revoke keys: use a key without limits or the Keys page.",
                       code="limited_key")


def _within_own_scopes(request: HttpRequest, scopes: list[str] | None, action: str, target: str) -> None:
    """A key gives no key more scopes than it holds itself (a manage-only key could otherwise make
    one that calls models or reads the console); a session may give any."""
    principal = getattr(request, "api_principal", None)
    wanted = set(scopes or KEY_SCOPES)
    if principal is not None and not wanted <= principal.scopes:
        record_audit(action=action, target=target, request=request, outcome=AuditOutcome.REFUSED,
                     detail={"reason": "scopes beyond the calling key's", "scopes": sorted(wanted)})
        raise ApiError(403, f"This API key holds {', '.join(sorted(principal.scopes))}: it cannot give a key "
                            f"{', '.join(sorted(wanted - principal.scopes))}.", code="scope_escalation")


def _key(key_id: int) -> ApiKey:
    key = ApiKey.objects.select_related("user").filter(pk=key_id).first()
    if key is None:
        raise ApiError(404, f"No API key {key_id}.", code="key_not_found")
    return key


@keys_router.post("", response={201: KeyCreatedOut}, auth=admin_auth, summary="Create an API key (admin)")
def create_key(request: HttpRequest, body: KeyIn):
    require_role(request, "admin")
    _unlimited_key_only(request, "key_create", body.name)
    owner = User.objects.filter(username=body.username, is_active=True).first()
    if owner is None:
        record_audit(action="key_create", target=body.name, request=request, outcome=AuditOutcome.REFUSED,
                     detail={"user": body.username, "reason": "no such active user"})
        raise ApiError(404, f"No active user {body.username!r}.", code="user_not_found")
    limits = {f: getattr(body, f) for f in LIMITS if getattr(body, f) is not None}
    _within_own_scopes(request, body.scopes, "key_create", body.name)
    try:
        key, raw = create_api_key(user=owner, name=body.name, expires_at=expiry_in(body.expires_in_days), **limits)
    except KeyInputError as exc:
        record_audit(action="key_create", target=body.name, request=request, outcome=AuditOutcome.REFUSED,
                     detail={"user": body.username, "reason": str(exc)})
        raise ApiError(400, str(exc), code="invalid_request") from None
    record_audit(action="key_create", target=f"key {key.pk} ({key.name})", request=request,
                 detail={"user": owner.username, **{f: key_out(key)[f] for f in LIMITS}})
    return Status(201, {**key_out(key), "key": raw})


@keys_router.get("", response=list[KeyOut], auth=admin_auth, summary="List API keys (admin; no secrets)")
def list_keys(request: HttpRequest):
    require_role(request, "admin")
    return [key_out(k) for k in ApiKey.objects.select_related("user").order_by("-created_at")[:1000]]


@keys_router.get("/{key_id}", response=KeyOut, auth=admin_auth, summary="One API key (admin)")
def get_key(request: HttpRequest, key_id: int):
    require_role(request, "admin")
    return key_out(_key(key_id))


@keys_router.patch("/{key_id}", response=KeyOut, auth=admin_auth, summary="Change a key's name, expiry or limits")
def patch_key(request: HttpRequest, key_id: int, body: KeyPatch):
    require_role(request, "admin")
    _unlimited_key_only(request, "key_change", f"key {key_id}")
    key = _key(key_id)
    sent = body.model_fields_set
    changes = {f: getattr(body, f) for f in (*LIMITS, "name") if f in sent}
    if "name" in changes and changes["name"] is None:
        raise ApiError(400, "name cannot be null.", code="invalid_request")
    if "scopes" in changes:
        if key.pk == getattr(request, "api_key_id", None):  # it would shut itself out of what it does now
            record_audit(action="key_change", target=f"key {key.pk} ({key.name})", request=request,
                         outcome=AuditOutcome.REFUSED, detail={"reason": "a key changing its own scopes"})
            raise ApiError(403, "A key cannot change its own scopes: use another key or the Keys page.",
                           code="own_scopes")
        _within_own_scopes(request, changes["scopes"], "key_change", f"key {key.pk} ({key.name})")
    try:
        if "expires_in_days" in sent:
            changes["expires_at"] = expiry_in(body.expires_in_days)
        changed = update_api_key(key=key, **changes)
    except KeyInputError as exc:
        record_audit(action="key_change", target=f"key {key.pk} ({key.name})", request=request,
                     outcome=AuditOutcome.REFUSED, detail={"reason": str(exc)})
        raise ApiError(400, str(exc), code="invalid_request") from None
    record_audit(action="key_change", target=f"key {key.pk} ({key.name})", request=request,
                 detail={"changed": changed, **{f: key_out(key)[f] for f in LIMITS}})
    return key_out(key)


@keys_router.delete("/{key_id}", response=KeyOut, auth=admin_auth, summary="Revoke an API key (admin)")
def delete_key(request: HttpRequest, key_id: int):
    require_role(request, "admin")
    if key_id != getattr(request, "api_key_id", None):  # any key may revoke itself
        _unlimited_key_only(request, "key_revoke", f"key {key_id}")
    key = _key(key_id)
    first = revoke_api_key(key=key)
    record_audit(action="key_revoke", target=f"key {key.pk} ({key.name})", request=request,
                 detail={} if first else {"already_revoked": True})
    return key_out(key)


class AuditQuery(Schema):
    actor: str | None = NinjaField(None, max_length=150)
    action: str | None = NinjaField(None, max_length=32)
    outcome: str | None = NinjaField(None, max_length=16)
    before: int | None = NinjaField(None, ge=1, description="only events with a smaller id (older pages)")
    limit: int = NinjaField(100, ge=1, le=1000)


@audit_router.get("", response=AuditPage, auth=admin_auth, summary="The audit log, newest first (admin)")
def audit_log(request: HttpRequest, query: Query[AuditQuery]):
    require_role(request, "admin")
    rows = AuditEvent.objects.all()
    if query.actor:
        rows = rows.filter(actor=query.actor)
    if query.action:
        rows = rows.filter(action=query.action)
    if query.outcome:
        rows = rows.filter(outcome=query.outcome)
    if query.before:
        rows = rows.filter(pk__lt=query.before)
    items = [{"id": e.pk, "time": e.at, "actor": e.actor, "action": e.action, "target": e.target,
              "outcome": e.outcome, "client": e.client, "detail": e.detail or {}}
             for e in rows.order_by("-pk")[: query.limit]]
    return {"items": items}
