"""The session check that ends a single sign-on session its provider no longer accepts: a middleware
beside accounts.sso (which accounts.oidc and accounts.ldap import), so that neither provider module
and the shared rules import each other round a cycle."""
from __future__ import annotations

import time

from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, logout
from django.http import HttpRequest
from django.shortcuts import redirect
from django.urls import reverse

from accounts import ldap, oidc
from accounts.credentials import SSO_SESSION_KEY, sso_check_age
from accounts.models import User
from accounts.sso import LDAP_BACKEND


class SsoSessionCheckMiddleware:
    """Every XGEN_SSO_RECHECK_S, a signed-in SSO session is checked with its provider: OIDC
    refreshes its tokens (a refused refresh ends the session), LDAP looks the user up again (gone,
    or outside XGEN_LDAP_REQUIRE_GROUP, ends it). Groups from the check are synced as at sign-in."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest):
        user = getattr(request, "user", None)
        state = request.session.get(SSO_SESSION_KEY) if user is not None and user.is_authenticated else None
        if user is not None and state and sso_check_age(state) >= settings.SSO_RECHECK_S:
            if not self._still_accepted(request, user, state):
                logout(request)
                if request.path.startswith(("/api/", "/v1/", "/metrics")):
                    return self.get_response(request)  # answered 401 as anonymous
                return redirect(f"{reverse('login')}?ended=1")
        return self.get_response(request)

    @staticmethod
    def _still_accepted(request: HttpRequest, user: User, state: dict) -> bool:
        source = state.get("source")
        if source == "oidc":
            ok, new_state = oidc.recheck(request, user, state)
        elif source == "ldap" and request.session.get(BACKEND_SESSION_KEY) == LDAP_BACKEND:
            ok, new_state = ldap.recheck(request, user, state)
        else:
            return False
        if ok:
            new_state["checked"] = time.time()
            request.session[SSO_SESSION_KEY] = new_state
        return ok
