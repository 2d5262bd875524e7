"""Sign-ins in the audit log: every success, every refusal, and sign-outs (Django's auth signals)."""
from __future__ import annotations

from typing import Any

from django.contrib.auth.signals import user_logged_in, user_logged_out, user_login_failed
from django.http import HttpRequest

from accounts.audit import record_audit
from accounts.models import AuditOutcome, User


def _logged_in(sender: object, request: HttpRequest, user: User, **kwargs: Any) -> None:
    record_audit(action="login", actor=user, target=user.get_username(), request=request)


def _login_failed(sender: object, credentials: dict[str, Any], request: HttpRequest | None = None,
                  **kwargs: Any) -> None:
    tried = str(credentials.get("username", ""))[:150]  # Django has masked the password already
    record_audit(action="login_failed", actor=tried, target=tried, request=request, outcome=AuditOutcome.REFUSED)


def _logged_out(sender: object, request: HttpRequest, user: User | None, **kwargs: Any) -> None:
    if user is not None:
        record_audit(action="logout", actor=user, target=user.get_username(), request=request)


def connect() -> None:
    user_logged_in.connect(_logged_in, dispatch_uid="xgen-audit-login")
    user_login_failed.connect(_login_failed, dispatch_uid="xgen-audit-login-failed")
    user_logged_out.connect(_logged_out, dispatch_uid="xgen-audit-logout")
