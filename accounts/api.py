"""The keys API (admin; mounted at /api/keys), the teams API (/api/teams: admin, and a team's lead for its
own team and keys) and the audit log API (admin; /api/audit)."""
from __future__ import annotations

from collections.abc import Sequence

from django.http import HttpRequest
from ninja import Field as NinjaField
from ninja import Query, Router, Schema, Status

from accounts.audit import record_audit
from accounts.auth import admin_auth, api_auth, require_role
from accounts.errors import ApiError
from accounts.models import KEY_SCOPES, ApiKey, AuditEvent, AuditOutcome, Team, TeamMembership, User
from accounts.schemas import (
    AuditPage,
    KeyCreatedOut,
    KeyIn,
    KeyOut,
    KeyPatch,
    MemberIn,
    TeamIn,
    TeamKeyIn,
    TeamOut,
    TeamPatch,
)
from accounts.services import (
    TEAM_LIMIT_FIELDS,
    KeyInputError,
    add_member,
    create_api_key,
    create_team,
    delete_team,
    expiry_in,
    remove_member,
    revoke_api_key,
    set_key_team,
    update_api_key,
    update_team,
)

keys_router = Router()
audit_router = Router()
teams_router = Router()

LIMITS = ("allowed_models", "rpm", "tpm", "daily_tokens", "monthly_tokens", "priority", "scopes")


def key_out(key: ApiKey) -> dict:
    return {
        "id": key.pk, "name": key.name, "prefix": key.prefix, "username": key.user.username,
        "role": "admin" if key.user.is_superuser else key.user.role, "created_at": key.created_at,
        "last_used": key.last_used_at, "expires_at": key.expires_at, "revoked_at": key.revoked_at,
        "active": key.is_usable, "allowed_models": list(key.allowed_models or []), "rpm": key.rpm, "tpm": key.tpm,
        "daily_tokens": key.daily_tokens, "monthly_tokens": key.monthly_tokens, "priority": key.priority,
        "scopes": list(key.scopes or []), "team": key.team.slug if key.team else None, "team_id": key.team_id,
    }


def _team_by_slug(slug: str | None, request: HttpRequest, action: str, target: str) -> Team | None:
    if not slug:
        return None
    team = Team.objects.filter(slug=slug).first()
    if team is None:
        record_audit(action=action, target=target, request=request, outcome=AuditOutcome.REFUSED,
                     detail={"team": slug, "reason": "no such team"})
        raise ApiError(404, f"No team {slug!r}.", code="team_not_found")
    return team


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


def _within_own_scopes(request: HttpRequest, scopes: Sequence[str] | None, action: str, target: str) -> None:
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
    key = ApiKey.objects.select_related("user", "team").filter(pk=key_id).first()
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
    team = _team_by_slug(body.team, request, "key_create", body.name)
    try:
        key, raw = create_api_key(user=owner, name=body.name, expires_at=expiry_in(body.expires_in_days),
                                  team=team, **limits)
    except KeyInputError as exc:
        record_audit(action="key_create", target=body.name, request=request, outcome=AuditOutcome.REFUSED,
                     detail={"user": body.username, "reason": str(exc)})
        raise ApiError(400, str(exc), code="invalid_request") from None
    record_audit(action="key_create", target=f"key {key.pk} ({key.name})", request=request,
                 detail={"user": owner.username, "team": body.team, **{f: key_out(key)[f] for f in LIMITS}})
    return Status(201, {**key_out(key), "key": raw})


@keys_router.get("", response=list[KeyOut], auth=admin_auth, summary="List API keys (admin; no secrets)")
def list_keys(request: HttpRequest):
    require_role(request, "admin")
    return [key_out(k) for k in ApiKey.objects.select_related("user", "team").order_by("-created_at")[:1000]]


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
    team = _team_by_slug(body.team, request, "key_change", f"key {key.pk} ({key.name})") if "team" in sent else None
    try:
        if "expires_in_days" in sent:
            changes["expires_at"] = expiry_in(body.expires_in_days)
        changed = update_api_key(key=key, **changes)
        if "team" in sent and set_key_team(key=key, team=team):
            changed.append("team")
    except KeyInputError as exc:
        record_audit(action="key_change", target=f"key {key.pk} ({key.name})", request=request,
                     outcome=AuditOutcome.REFUSED, detail={"reason": str(exc)})
        raise ApiError(400, str(exc), code="invalid_request") from None
    record_audit(action="key_change", target=f"key {key.pk} ({key.name})", request=request,
                 detail={"changed": changed, "team": key_out(key)["team"], **{f: key_out(key)[f] for f in LIMITS}})
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


# ---------------------------------------------------------------- teams
def team_out(team: Team) -> dict:
    members = [{"username": m.user.username, "source": m.source, "is_lead": m.is_lead}
               for m in team.memberships.select_related("user").order_by("user__username")]
    return {"id": team.pk, "name": team.name, "slug": team.slug, "created_at": team.created_at,
            "allowed_models": list(team.allowed_models or []), "rpm": team.rpm, "tpm": team.tpm,
            "daily_tokens": team.daily_tokens, "monthly_tokens": team.monthly_tokens,
            "gpu_seconds_month": team.gpu_seconds_month, "members": members, "keys": team.api_keys.count()}


def _caller(request: HttpRequest) -> User:
    return getattr(request, "auth", None) or request.user


def _team(request: HttpRequest, team_id: int, *, manage: bool = False, action: str = "") -> Team:
    """The team, for an admin or (reading, or `manage`: its keys) its lead; 404 for anyone else, as
    for a team that does not exist (a lead learns nothing of other teams, not even their ids)."""
    user = _caller(request)
    team = Team.objects.filter(pk=team_id).first()
    if team is None or not user.leads(team.pk):
        if action:
            record_audit(action=action, target=f"team {team_id}", request=request, outcome=AuditOutcome.REFUSED,
                         detail={"reason": "no such team, or not its lead"})
        raise ApiError(404, f"No team {team_id}.", code="team_not_found")
    if manage:
        _unlimited_key_only(request, action, f"team {team_id}")
    return team


@teams_router.get("", response=list[TeamOut], auth=api_auth, summary="Teams (admin: all; a team lead: its own)")
def list_teams(request: HttpRequest):
    user = _caller(request)
    teams = Team.objects.all()
    if not user.has_role("admin"):
        teams = teams.filter(memberships__user=user, memberships__is_lead=True)
    return [team_out(t) for t in teams.order_by("name")[:1000]]


@teams_router.post("", response={201: TeamOut}, auth=admin_auth, summary="Create a team (admin)")
def create_team_api(request: HttpRequest, body: TeamIn):
    require_role(request, "admin")
    _unlimited_key_only(request, "team_create", body.name)
    fields = {f: getattr(body, f) for f in TEAM_LIMIT_FIELDS if getattr(body, f) is not None}
    try:
        team = create_team(name=body.name, slug=body.slug, **fields)
    except KeyInputError as exc:
        record_audit(action="team_create", target=body.name, request=request, outcome=AuditOutcome.REFUSED,
                     detail={"reason": str(exc)})
        raise ApiError(400, str(exc), code="invalid_request") from None
    out = team_out(team)
    record_audit(action="team_create", target=f"team {team.pk} ({team.slug})", request=request,
                 detail={f: out[f] for f in ("name", "slug", *TEAM_LIMIT_FIELDS)})
    return Status(201, out)


@teams_router.get("/{team_id}", response=TeamOut, auth=api_auth, summary="One team (admin, or its lead)")
def get_team(request: HttpRequest, team_id: int):
    return team_out(_team(request, team_id))


@teams_router.patch("/{team_id}", response=TeamOut, auth=admin_auth, summary="Change a team's name or limits (admin)")
def patch_team(request: HttpRequest, team_id: int, body: TeamPatch):
    require_role(request, "admin")
    _unlimited_key_only(request, "team_change", f"team {team_id}")
    team = _team(request, team_id, action="team_change")
    changes = {f: getattr(body, f) for f in body.model_fields_set}
    for field in ("name", "slug"):
        if field in changes and changes[field] is None:
            raise ApiError(400, f"{field} cannot be null.", code="invalid_request")
    try:
        changed = update_team(team=team, **changes)
    except KeyInputError as exc:
        record_audit(action="team_change", target=f"team {team.pk} ({team.slug})", request=request,
                     outcome=AuditOutcome.REFUSED, detail={"reason": str(exc)})
        raise ApiError(400, str(exc), code="invalid_request") from None
    out = team_out(team)
    record_audit(action="team_change", target=f"team {team.pk} ({team.slug})", request=request,
                 detail={"changed": changed, **{f: out[f] for f in ("name", "slug", *TEAM_LIMIT_FIELDS)}})
    return out


@teams_router.delete("/{team_id}", response=TeamOut, auth=admin_auth,
                     summary="Delete a team (admin); its keys stay, without a team")
def delete_team_api(request: HttpRequest, team_id: int):
    require_role(request, "admin")
    _unlimited_key_only(request, "team_delete", f"team {team_id}")
    team = _team(request, team_id, action="team_delete")
    out = team_out(team)
    keys = delete_team(team=team)
    record_audit(action="team_delete", target=f"team {out['id']} ({out['slug']})", request=request,
                 detail={"keys_left_without_team": keys, "members": [m["username"] for m in out["members"]]})
    return out


@teams_router.post("/{team_id}/members", response=TeamOut, auth=admin_auth,
                   summary="Add a user to a team, or make a member lead (admin)")
def add_team_member(request: HttpRequest, team_id: int, body: MemberIn):
    require_role(request, "admin")
    _unlimited_key_only(request, "team_member_add", f"team {team_id}")
    team = _team(request, team_id, action="team_member_add")
    user = User.objects.filter(username=body.username).first()
    if user is None:
        record_audit(action="team_member_add", target=f"team {team.pk} ({team.slug})", request=request,
                     outcome=AuditOutcome.REFUSED, detail={"user": body.username, "reason": "no such user"})
        raise ApiError(404, f"No user {body.username!r}.", code="user_not_found")
    _, created = add_member(team=team, user=user, is_lead=body.is_lead)
    record_audit(action="team_member_add", target=f"team {team.pk} ({team.slug})", request=request,
                 detail={"user": user.username, "is_lead": body.is_lead, "created": created})
    return team_out(team)


@teams_router.delete("/{team_id}/members/{username}", response=TeamOut, auth=admin_auth,
                     summary="Take a user out of a team (admin)")
def remove_team_member(request: HttpRequest, team_id: int, username: str):
    require_role(request, "admin")
    _unlimited_key_only(request, "team_member_remove", f"team {team_id}")
    team = _team(request, team_id, action="team_member_remove")
    user = User.objects.filter(username=username[:150]).first()
    if user is None or not remove_member(team=team, user=user):
        raise ApiError(404, f"{username[:150]!r} is not in the team.", code="member_not_found")
    record_audit(action="team_member_remove", target=f"team {team.pk} ({team.slug})", request=request,
                 detail={"user": user.username})
    return team_out(team)


@teams_router.get("/{team_id}/keys", response=list[KeyOut], auth=api_auth,
                  summary="The team's keys (admin, or the team's lead; no secrets)")
def team_keys(request: HttpRequest, team_id: int):
    team = _team(request, team_id)
    return [key_out(k) for k in ApiKey.objects.select_related("user", "team").filter(team=team)
            .order_by("-created_at")[:1000]]


@teams_router.post("/{team_id}/keys", response={201: KeyCreatedOut}, auth=api_auth,
                   summary="Create a key owned by the team (admin, or the team's lead)")
def create_team_key(request: HttpRequest, team_id: int, body: TeamKeyIn):
    team = _team(request, team_id, manage=True, action="key_create")
    caller = _caller(request)
    username = body.username or caller.get_username()
    owner = User.objects.filter(username=username, is_active=True).first()
    if owner is None or not (caller.has_role("admin") or TeamMembership.objects.filter(team=team, user=owner).exists()):
        record_audit(action="key_create", target=body.name, request=request, outcome=AuditOutcome.REFUSED,
                     detail={"team": team.slug, "user": username, "reason": "not an active member of the team"})
        raise ApiError(404, f"No active member {username!r} in the team.", code="user_not_found")
    scopes = body.scopes or ["inference"]
    _within_own_scopes(request, scopes, "key_create", body.name)
    limits = {f: getattr(body, f) for f in ("allowed_models", "rpm", "tpm", "daily_tokens", "monthly_tokens")
              if getattr(body, f) is not None}
    try:
        key, raw = create_api_key(user=owner, name=body.name, expires_at=expiry_in(body.expires_in_days),
                                  team=team, scopes=scopes, **limits)
    except KeyInputError as exc:
        record_audit(action="key_create", target=body.name, request=request, outcome=AuditOutcome.REFUSED,
                     detail={"team": team.slug, "user": username, "reason": str(exc)})
        raise ApiError(400, str(exc), code="invalid_request") from None
    record_audit(action="key_create", target=f"key {key.pk} ({key.name})", request=request,
                 detail={"user": owner.username, "team": team.slug, **{f: key_out(key)[f] for f in LIMITS}})
    return Status(201, {**key_out(key), "key": raw})


@teams_router.delete("/{team_id}/keys/{key_id}", response=KeyOut, auth=api_auth,
                     summary="Revoke a key of the team (admin, or the team's lead)")
def revoke_team_key(request: HttpRequest, team_id: int, key_id: int):
    team = _team(request, team_id, manage=key_id != getattr(request, "api_key_id", None), action="key_revoke")
    key = ApiKey.objects.select_related("user", "team").filter(pk=key_id, team=team).first()
    if key is None:
        raise ApiError(404, f"No API key {key_id} in the team.", code="key_not_found")
    first = revoke_api_key(key=key)
    record_audit(action="key_revoke", target=f"key {key.pk} ({key.name})", request=request,
                 detail={"team": team.slug, **({} if first else {"already_revoked": True})})
    return key_out(key)
