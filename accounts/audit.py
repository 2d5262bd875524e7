"""The audit log's one writer: `record_audit(...)`, called by every app's views and API functions
(and the sign-in signals) for each change and each sign-in, success or refusal."""
from __future__ import annotations

import logging

from django.http import HttpRequest

from accounts.models import AuditEvent, AuditOutcome

log = logging.getLogger("xgen.audit")

# The actions the console records (api.md); others may be added, never renamed.
ACTIONS = (
    "login", "login_failed", "login_locked", "logout", "load", "unload", "restart", "start", "scale", "autoscale", "autoscale_settings", "relocate", "rollout", "model_delete", "download", "upload",
    "key_create", "key_change", "key_revoke", "user_create", "user_change", "password_change",
    "sso_sync", "sso_groups_missing", "sso_deprovision",
    "team_create", "team_change", "team_delete", "team_member_add", "team_member_remove", "team_sync",
    "preset", "preset_delete", "adapter_add", "adapter_remove",
)


def client_address(request: HttpRequest | None) -> str:
    """The peer address Django saw (a TLS proxy in front shows as itself)."""
    if request is None:
        return ""
    return str(request.META.get("REMOTE_ADDR") or "")[:64]


def record_audit(*, action: str, actor=None, target: str = "", outcome: str = AuditOutcome.SUCCESS,
                 request: HttpRequest | None = None, detail: dict | None = None) -> AuditEvent | None:
    """Append one audit row. `actor` is a user, a name ("cli"), or None for the request's user.

    Never raises: the change it records has happened (or been refused) already; a failed write is
    logged with everything the row would have held.
    """
    if actor is None and request is not None:
        actor = getattr(request, "auth", None) or getattr(request, "user", None)
    if actor is not None and not isinstance(actor, str) and getattr(actor, "is_authenticated", False):
        actor_name, actor_id = actor.get_username(), actor.pk
    else:
        actor_name, actor_id = (actor if isinstance(actor, str) else ""), None
    extra = dict(detail or {})
    if request is not None:
        via_key = getattr(request, "api_key_id", None)
        extra.setdefault("via", "api" if request.path.startswith("/api/") else "page")
        if via_key:
            extra.setdefault("key_id", via_key)
    try:
        return AuditEvent.objects.create(
            actor=actor_name[:150], actor_id=actor_id, action=action, target=str(target)[:300],
            outcome=outcome, client=client_address(request), detail=extra,
        )
    except Exception:
        log.exception("audit row not written: %s %s %s (%s) %s", actor_name, action, target, outcome, extra)
        return None
