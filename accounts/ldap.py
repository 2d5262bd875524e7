"""Sign-in against an LDAP directory or Active Directory (XGEN_LDAP_*), through django-auth-ldap:
the user is found with the bind DN (or bound as directly), then the password is checked by binding
as the user; the user's groups are synced to a role (accounts.sso) at each sign-in and each session
check, when the user is also looked up again (gone, or outside XGEN_LDAP_REQUIRE_GROUP: the session
ends and the user is deprovisioned)."""
from __future__ import annotations

import logging
import time

from django.conf import settings
from django.contrib.auth.signals import user_logged_in
from django.http import HttpRequest
from django_auth_ldap.backend import LDAPBackend, _LDAPUser

from accounts.models import IdpSource, Role, User
from accounts.sso import LDAP_BACKEND, SESSION_KEY, apply_groups, deprovision

log = logging.getLogger("xgen.sso")


def _groups(ldap_user: _LDAPUser) -> list[str] | None:
    """The user's groups as DNs and as names (the mapping may use either); None when no group
    search is configured (nothing known, so nothing changes)."""
    if getattr(settings, "AUTH_LDAP_GROUP_SEARCH", None) is None:
        return None
    return sorted(set(ldap_user.group_dns) | set(ldap_user.group_names))


class LdapBackend(LDAPBackend):
    """django-auth-ldap's backend, when XGEN_LDAP_URL is set. A name that is a local user's (or an
    OIDC user's) is never taken over by a directory entry of the same name."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if not getattr(settings, "AUTH_LDAP_SERVER_URI", ""):
            return None
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is not None:
            apply_groups(user, _groups(user.ldap_user), source="ldap", request=request)
        return user

    def get_or_build_user(self, username, ldap_user):
        user, built = super().get_or_build_user(username, ldap_user)
        if built:
            user.idp_source, user.idp_subject, user.local_role, user.role = IdpSource.LDAP, ldap_user.dn, "", Role.VIEWER
        elif user.idp_source != IdpSource.LDAP:
            raise ldap_user.AuthenticationFailed(f"{username!r} is a {user.idp_source or 'local'} user, not LDAP's")
        else:
            user.idp_subject = ldap_user.dn
        return user, built


def _mark_session(sender, request, user, **kwargs) -> None:
    if request is not None and getattr(user, "backend", "") == LDAP_BACKEND:
        request.session[SESSION_KEY] = {"source": "ldap", "checked": time.time()}


user_logged_in.connect(_mark_session, dispatch_uid="xgen-ldap-session")


def recheck(request: HttpRequest, user: User, state: dict) -> tuple[bool, dict]:
    """Look the user up again with the bind DN: gone, or no longer allowed (XGEN_LDAP_REQUIRE_GROUP),
    ends the session and deprovisions; else the groups are synced."""
    import ldap

    backend = LdapBackend()
    if not settings.AUTH_LDAP_SERVER_URI:
        return False, state
    ldap_user = _LDAPUser(backend, username=user.get_username())
    try:
        ldap_user._bind()  # a directory that is down raises here, and is not read as "the user is gone"
        if ldap_user.dn is None:
            deprovision(user, source="ldap", reason="no longer in the directory", request=request)
            return False, state
        try:
            ldap_user._check_requirements()
        except ldap_user.AuthenticationFailed as exc:
            deprovision(user, source="ldap", reason=str(exc), request=request)
            return False, state
        groups = _groups(ldap_user)
    except ldap.LDAPError as exc:
        log.warning("LDAP check of %s: the directory cannot be used (%s); the session ends", user.username, exc)
        return False, state
    apply_groups(user, groups, source="ldap", request=request)
    return True, state
