"""What single sign-on (accounts.oidc, accounts.ldap) shares: the identity provider's groups mapped
to roles (XGEN_SSO_GROUP_ROLES) and to teams (XGEN_SSO_GROUP_TEAMS) at each sign-in, password sign-in limited to break-glass users when
local login is off, and the session check that ends a session the provider no longer accepts.

A user's role is the higher of its local role (given in the console) and its IdP role (from the
groups); a sync changes only the IdP role, so it never takes away what an admin gave here. A sign-in
without the groups claim keeps the last known groups and says so in the audit log.
"""
from __future__ import annotations

import json
import logging

from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest
from django.utils import timezone

from accounts.audit import record_audit
from accounts.credentials import SSO_SESSION_KEY, notify_changed
from accounts.models import ROLE_RANK, ApiKey, AuditOutcome, Role, User, effective_role

log = logging.getLogger("xgen.sso")

SESSION_KEY = SSO_SESSION_KEY  # {"source": "oidc"|"ldap", "checked": unix time, "refresh_token": ...}
LDAP_BACKEND = "accounts.ldap.LdapBackend"
IDP_BACKEND = "django.contrib.auth.backends.ModelBackend"  # loads an OIDC session's user


class MappingError(ValueError):
    pass


def parse_group_roles(raw: str) -> dict[str, str]:
    """XGEN_SSO_GROUP_ROLES: a JSON object {"group": "role"} or "group=role,group=role"; group names
    compare without case (LDAP DNs and names, OIDC claim values)."""
    raw = (raw or "").strip()
    if not raw:
        return {}
    if raw.startswith("{"):
        try:
            pairs = json.loads(raw)
        except ValueError as exc:
            raise MappingError(f"XGEN_SSO_GROUP_ROLES is not valid JSON: {exc}") from None
        if not isinstance(pairs, dict):
            raise MappingError("XGEN_SSO_GROUP_ROLES must be a JSON object of group -> role")
        items = list(pairs.items())
    else:
        items = []
        for part in raw.split(","):
            if not part.strip():
                continue
            group, sep, role = part.rpartition("=")
            if not sep or not group.strip() or "=" in group:
                raise MappingError(f"XGEN_SSO_GROUP_ROLES entry {part.strip()!r} is not group=role "
                                   f"(a DN has commas and '=': map DNs in the JSON form)")
            items.append((group, role))
    out = {}
    for group, role in items:
        role = str(role).strip().lower()
        if role not in Role.values:
            raise MappingError(f"XGEN_SSO_GROUP_ROLES maps {group!r} to {role!r}, not one of {', '.join(Role.values)}")
        out[str(group).strip().lower()] = role
    return out


def parse_group_teams(raw: str) -> dict[str, list[str]]:
    """XGEN_SSO_GROUP_TEAMS: a JSON object {"group": "team-slug" or ["slug", ...]} or
    "group=slug,group=slug" (a group named twice joins several teams); groups compare without case."""
    raw = (raw or "").strip()
    if not raw:
        return {}
    items: list[tuple[str, object]] = []
    if raw.startswith("{"):
        try:
            pairs = json.loads(raw)
        except ValueError as exc:
            raise MappingError(f"XGEN_SSO_GROUP_TEAMS is not valid JSON: {exc}") from None
        if not isinstance(pairs, dict):
            raise MappingError("XGEN_SSO_GROUP_TEAMS must be a JSON object of group -> team slug(s)")
        items = list(pairs.items())
    else:
        for part in raw.split(","):
            if not part.strip():
                continue
            group, sep, slug = part.rpartition("=")
            if not sep or not group.strip() or "=" in group:
                raise MappingError(f"XGEN_SSO_GROUP_TEAMS entry {part.strip()!r} is not group=team "
                                   f"(a DN has commas and '=': map DNs in the JSON form)")
            items.append((group, slug))
    out: dict[str, list[str]] = {}
    for group, value in items:
        values = value if isinstance(value, list) else [value]
        mine = out.setdefault(str(group).strip().lower(), [])
        for raw_slug in values:
            slug = str(raw_slug).strip().lower()
            if not slug or not slug.replace("-", "").replace("_", "").isalnum() or not slug.isascii():
                raise MappingError(f"XGEN_SSO_GROUP_TEAMS maps {group!r} to {slug!r}, not a team slug")
            if slug not in mine:
                mine.append(slug)
    return out


def group_teams() -> dict[str, list[str]]:
    return parse_group_teams(getattr(settings, "SSO_GROUP_TEAMS", ""))


def mapping_rows() -> tuple[list[dict], str]:
    """The group mapping as the Teams page shows it to admins: one row per mapped group (its role,
    its teams and whether each exists: a mapping never makes a team), and the settings' error ("" if
    none) when a mapping cannot be read."""
    from accounts.models import Team

    try:
        roles, teams = group_roles(), group_teams()
    except MappingError as exc:
        return [], str(exc)
    known = set(Team.objects.filter(slug__in=sorted({s for slugs in teams.values() for s in slugs}))
                .values_list("slug", flat=True))
    return [{"group": g, "role": roles.get(g, ""), "teams": [(slug, slug in known) for slug in teams.get(g, [])]}
            for g in sorted(set(roles) | set(teams))], ""


def sync_teams(user: User, groups: list[str]) -> dict[str, list[str]]:
    """The user's IdP team memberships made to match its groups (XGEN_SSO_GROUP_TEAMS): idp
    memberships added and removed, local ones never touched (a team the user is in locally stays
    local). Returns {"added": slugs, "removed": slugs, "unknown": slugs mapped but with no team}."""
    from accounts.models import MembershipSource, Team, TeamMembership

    mapping = group_teams()
    wanted = sorted({slug for g in groups for slug in mapping.get(g.lower(), [])})
    teams = {t.slug: t for t in Team.objects.filter(slug__in=wanted)}
    current = {m.team_id: m for m in TeamMembership.objects.filter(user=user).select_related("team")}
    added, removed = [], []
    for slug, team in sorted(teams.items()):
        if team.pk not in current:
            TeamMembership.objects.create(team=team, user=user, source=MembershipSource.IDP)
            added.append(slug)
    for m in current.values():
        if m.source == MembershipSource.IDP and m.team.slug not in teams:
            m.delete()
            removed.append(m.team.slug)
    return {"added": added, "removed": sorted(removed), "unknown": [s for s in wanted if s not in teams]}


def user_teams(user: User) -> list[str]:
    """The slugs of the user's teams (any source)."""
    return sorted(user.team_memberships.values_list("team__slug", flat=True))


def group_roles() -> dict[str, str]:
    return parse_group_roles(getattr(settings, "SSO_GROUP_ROLES", ""))


def role_for_groups(groups: list[str], mapping: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """The highest role the groups map to ("" for none) and the groups that matched."""
    mapping = group_roles() if mapping is None else mapping
    matched = sorted({g for g in groups if g.lower() in mapping})
    roles = [mapping[g.lower()] for g in matched]
    best = max(roles, key=lambda r: ROLE_RANK[Role(r)]) if roles else ""
    return best, matched


def apply_groups(user: User, groups: list[str] | None, *, source: str, request: HttpRequest | None,
                 actor: object = None) -> None:
    """Sync a signed-in (or re-checked) SSO user's IdP role from its groups; None: the provider sent
    no groups, so the last known ones stay (and the audit log says so)."""
    if groups is None:
        record_audit(action="sso_groups_missing", actor=actor or user, target=user.get_username(), request=request,
                     outcome=AuditOutcome.FAILED,
                     detail={"source": source, "kept_groups": user.idp_groups, "role": user.role,
                             "kept_teams": user_teams(user),
                             "note": "the identity provider sent no groups: the last known memberships are kept"})
        return
    groups = sorted({str(g) for g in groups})
    idp_role, matched = role_for_groups(groups)
    before = (user.role, user.idp_role)
    user.idp_groups = groups
    user.idp_role = idp_role
    user.role = effective_role(user.local_role, idp_role)
    user.is_staff = user.role == Role.ADMIN
    user.idp_synced_at = timezone.now()
    user.save(update_fields=["idp_groups", "idp_role", "role", "is_staff", "idp_synced_at"])
    teams = sync_teams(user, groups)
    if teams["added"] or teams["removed"] or teams["unknown"]:
        record_audit(action="team_sync", actor=actor or user, target=user.get_username(), request=request,
                     outcome=AuditOutcome.SUCCESS if not teams["unknown"] else AuditOutcome.FAILED,
                     detail={"source": source, **teams, "teams": user_teams(user)})
    if before != (user.role, user.idp_role):
        notify_changed("all")  # keys and sessions of this user carry the old role
        record_audit(action="sso_sync", actor=actor or user, target=user.get_username(), request=request,
                     detail={"source": source, "from": before[0], "to": user.role, "idp_role": idp_role,
                             "matched_groups": matched})


def deprovision(user: User, *, source: str, reason: str, request: HttpRequest | None) -> None:
    """The provider no longer accepts the user: every session of theirs ends (the session hash
    changes with the unusable password) and their keys follow XGEN_SSO_DEPROVISIONED_KEYS."""
    from accounts.services import revoke_api_key

    user.set_unusable_password()
    user.save(update_fields=["password"])
    revoked = []
    if settings.SSO_DEPROVISIONED_KEYS == "revoke":
        for key in ApiKey.objects.filter(user=user, revoked_at__isnull=True):
            revoke_api_key(key=key)
            revoked.append(key.prefix)
    notify_changed("all")
    record_audit(action="sso_deprovision", actor="sso", target=user.get_username(), request=request,
                 detail={"source": source, "reason": reason, "keys": settings.SSO_DEPROVISIONED_KEYS,
                         "revoked_keys": revoked})


# ---------------------------------------------------------------- password sign-in
class LocalLoginGate:
    """Before Django's ModelBackend (PermissionDenied stops Django's backend chain): an SSO user never
    signs in with a console password; with XGEN_LOCAL_LOGIN=false, nor does a local user who is not
    in XGEN_BREAK_GLASS_USERS."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if username is None:
            return None
        source = User.objects.filter(username=username).values_list("idp_source", flat=True).first()
        if source:  # an SSO user: its provider checks it (LDAP's backend ran already); never a password here
            raise PermissionDenied(f"{username!r} signs in with {source}")
        if settings.LOCAL_LOGIN or username in settings.BREAK_GLASS_USERS:
            return None
        if source == "":
            raise PermissionDenied("local sign-in is off (XGEN_LOCAL_LOGIN=false)")
        return None

    def get_user(self, user_id):
        return None


# ---------------------------------------------------------------- the session check


def sso_context(request: HttpRequest) -> dict:
    """What the sign-in page shows beside the password form: the provider's button, whether the form is
    for everyone (local users, LDAP) or for break-glass admins only, and why a session ended."""
    ldap_on = bool(getattr(settings, "AUTH_LDAP_SERVER_URI", ""))
    return {"sso_name": settings.OIDC_NAME, "password_for_all": settings.LOCAL_LOGIN or ldap_on,
            "session_ended": request.GET.get("ended") == "1"}
