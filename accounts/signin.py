"""The sign-in throttle's parts of our own (django-axes counts the failures; settings AXES_*):
the answer to a locked-out sign-in, the audit row of a lockout, and the reset that follows a
successful sign-in, which clears that user name's count and never a client address's (axes' own
reset would clear the address too, so an attacker with an account of their own could sign in to
it every 9 tries and go on guessing another user's password from the same address)."""
from __future__ import annotations

from axes.backends import AxesStandaloneBackend
from django.conf import settings
from django.contrib.auth.forms import AuthenticationForm
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from accounts.audit import record_audit
from accounts.models import AuditOutcome
from accounts.sso import sso_context


class SignInThrottleBackend(AxesStandaloneBackend):
    """axes' check, for sign-ins that come with a request (the sign-in page); a check of a password
    without one (a management shell, a script) goes on to the next backend, where axes raised."""

    def authenticate(self, request: HttpRequest | None, username: str | None = None, password: str | None = None,
                     **kwargs: object) -> None:
        if request is None:
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)


def cooloff_text() -> str:
    seconds = int(settings.AXES_COOLOFF_TIME.total_seconds())
    return f"{seconds // 60} minutes" if seconds >= 120 and seconds % 60 == 0 else f"{seconds} seconds"


def locked_out_response(request: HttpRequest, original_response: object = None,
                        credentials: object = None) -> HttpResponse:
    """The sign-in page again, 429, saying why and for how long (axes calls this with
    (request, response, credentials) or, on its async path, (request, credentials))."""
    message = (f"Too many failed sign-ins for this user name or from this address: sign-in is paused for "
               f"{cooloff_text()}.")
    from accounts import oidc

    context = {"form": AuthenticationForm(request), "locked_out": message, "next": request.POST.get("next", ""),
               "oidc_enabled": oidc.enabled(), **sso_context(request)}
    response = render(request, "accounts/login.html", context, status=429)
    response["Retry-After"] = str(int(settings.AXES_COOLOFF_TIME.total_seconds()))
    return response


def _locked_out(sender, request=None, username=None, ip_address=None, **kwargs) -> None:
    tried = str(username or "")[:150]
    record_audit(action="login_locked", actor=tried, target=tried, request=request, outcome=AuditOutcome.REFUSED,
                 detail={"limit": settings.AXES_FAILURE_LIMIT, "cooloff_s": int(settings.AXES_COOLOFF_TIME.total_seconds())})


def _signed_in(sender, request, user, **kwargs) -> None:
    from axes.models import AccessAttempt

    AccessAttempt.objects.filter(username=user.get_username()).delete()


def connect() -> None:
    from axes.signals import user_locked_out
    from django.contrib.auth.signals import user_logged_in

    user_locked_out.connect(_locked_out, dispatch_uid="xgen-audit-login-locked")
    user_logged_in.connect(_signed_in, dispatch_uid="xgen-signin-reset")
