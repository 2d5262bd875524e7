"""Writes for users and API keys."""
from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from accounts.credentials import notify_changed
from accounts.models import (
    KEY_SCOPES,
    ApiKey,
    MembershipSource,
    Role,
    Team,
    TeamMembership,
    User,
    effective_role,
    hash_key,
)

# The limit fields of a key, as the API, the Keys page and createapikey name them.
LIMIT_FIELDS = ("allowed_models", "rpm", "tpm", "daily_tokens", "monthly_tokens", "priority", "scopes")
MAX_PRIORITY = 9
# The names the API, the CLI and the Keys page take for a priority (the integer 0-9 works as well).
PRIORITY_NAMES = {"low": 1, "normal": 4, "high": 7}
DEFAULT_PRIORITY = PRIORITY_NAMES["normal"]


def priority_value(value: int | str | None) -> int | str | None:
    """A priority name as its number; anything else as it is (checked by clean_limits)."""
    if isinstance(value, str):
        name = value.strip().lower()
        if name in PRIORITY_NAMES:
            return PRIORITY_NAMES[name]
        if name.isdigit():
            return int(name)
    return value


class KeyInputError(ValueError):
    """A key field out of range (the API answers 400)."""


def create_user(*, username: str, role: str, password: str | None, email: str = "") -> User:
    """A user with `role` (admins are staff too); ValueError for an unknown role."""
    if role not in Role.values:
        raise ValueError(f"role must be one of {', '.join(Role.values)}")
    with transaction.atomic():
        user = User.objects.create_user(username=username, email=email, password=password, role=role)
        if role == Role.ADMIN:
            user.is_staff = True
            user.save(update_fields=["is_staff"])
    return user


def update_user(*, user: User, role: str, is_active: bool, new_password: str = "") -> list[str]:
    """Set a user's role, activity and (optionally) password; the names of what changed.

    A superuser demoted below admin stops being a superuser (superusers rank as admin).
    """
    changed = []
    if role not in Role.values:
        raise ValueError(f"role must be one of {', '.join(Role.values)}")
    if user.role != role:
        changed.append("role")
    if user.is_superuser and role != Role.ADMIN:
        user.is_superuser = False
        changed.append("is_superuser")
    if user.is_active != is_active:
        changed.append("is_active")
    # The role set here is the user's local one; a role from the identity provider's groups above it
    # stays in effect (accounts.sso) until the provider takes it back.
    user.local_role = role
    role = effective_role(role, user.idp_role)
    user.role = role
    user.is_staff = role == Role.ADMIN
    user.is_active = is_active
    if new_password:
        user.set_password(new_password)
        changed.append("password")
    user.save()
    notify_changed("all")  # keys and sessions of this user carry the old role
    return changed


def clean_limits(values: dict) -> dict:
    """Key limits as stored: counts >= 1 or None (unlimited), model names stripped, priority 0-9."""
    out: dict[str, list[str] | int | None] = {}
    for field, value in values.items():
        if field == "allowed_models":
            if value is None:
                value = []
            if not isinstance(value, list | tuple) or not all(isinstance(m, str) for m in value):
                raise KeyInputError("allowed_models must be a list of model names.")
            names = sorted({m.strip() for m in value if m.strip()})
            if any(len(m) > 255 for m in names) or len(names) > 500:
                raise KeyInputError("allowed_models: at most 500 names of 255 characters.")
            out[field] = names
        elif field == "scopes":
            if value is None:
                value = list(KEY_SCOPES)
            if (not isinstance(value, list | tuple) or not value
                    or not all(isinstance(s, str) and s in KEY_SCOPES for s in value)):
                raise KeyInputError(f"scopes must be a non-empty list of {', '.join(KEY_SCOPES)}.")
            out[field] = [s for s in KEY_SCOPES if s in value]
        elif field == "priority":
            value = DEFAULT_PRIORITY if value is None else priority_value(value)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_PRIORITY:
                raise KeyInputError(f"priority must be high, normal, low or 0-{MAX_PRIORITY}.")
            out[field] = value
        elif field in LIMIT_FIELDS:
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 1 <= value <= 10**15):
                raise KeyInputError(f"{field} must be a whole number of at least 1, or empty for unlimited.")
            out[field] = value
        else:
            raise KeyInputError(f"unknown key field {field!r}")
    return out


def expiry_in(days: int | None) -> datetime | None:
    if days is None:
        return None
    if not isinstance(days, int) or not 1 <= days <= 3650:
        raise KeyInputError("expires_in_days must be 1-3650.")
    return timezone.now() + timedelta(days=days)


def create_api_key(*, user: User, name: str, expires_at: datetime | None = None, team: Team | None = None,
                   **limits) -> tuple[ApiKey, str]:
    """Returns the stored key and the raw key, which is never stored or shown again.
    `limits`: allowed_models, rpm, tpm, daily_tokens, monthly_tokens, priority (absent: unlimited), scopes
    (absent: all three); `team`: the team that owns it (its limits apply too)."""
    raw = ApiKey.generate()
    key = ApiKey.objects.create(
        user=user, name=(name or "key")[:100], prefix=raw[:12], key_hash=hash_key(raw), expires_at=expires_at,
        team=team, **clean_limits(limits),
    )
    return key, raw


def update_api_key(*, key: ApiKey, **changes) -> list[str]:
    """Change a key's name, expiry (`expires_at`) or limits; the names of the fields that changed.
    Takes effect at once in this process and, pushed, within moments everywhere."""
    fields = {}
    if "name" in changes:
        name = (changes.pop("name") or "").strip()
        if not name or len(name) > 100:
            raise KeyInputError("name must be 1-100 characters.")
        fields["name"] = name
    if "expires_at" in changes:
        fields["expires_at"] = changes.pop("expires_at")
    fields.update(clean_limits(changes))
    changed = [f for f, v in fields.items() if getattr(key, f) != v]
    for field in changed:
        setattr(key, field, fields[field])
    if changed:
        key.save(update_fields=changed)
        notify_changed("keys", key.key_hash)
    return changed


def revoke_api_key(*, key: ApiKey) -> bool:
    """Revoked from now on: every process's key cache forgets it (this one at once, others when
    the push arrives, within the TTL at worst). False when it was revoked already."""
    first = key.revoked_at is None
    if first:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
    notify_changed("keys", key.key_hash)
    return first


# ---------------------------------------------------------------- teams
TEAM_LIMIT_FIELDS = ("allowed_models", "rpm", "tpm", "daily_tokens", "monthly_tokens", "gpu_seconds_month")


def clean_team(values: dict) -> dict:
    """Team fields as stored: name 1-100 characters, slug lower-case letters, digits, - and _
    (made from the name when absent), limits as a key's (counts >= 1 or None)."""
    from django.utils.text import slugify

    out: dict = {}
    if "name" in values:
        name = (values["name"] or "").strip()
        if not name or len(name) > 100:
            raise KeyInputError("name must be 1-100 characters.")
        out["name"] = name
    if "slug" in values:
        slug = values["slug"]
        slug = slugify(slug if slug else out.get("name", "")).strip("-_")[:50]
        if not slug:
            raise KeyInputError("slug must have a letter or digit (a-z, 0-9, - and _).")
        out["slug"] = slug
    limits = {f: v for f, v in values.items() if f in TEAM_LIMIT_FIELDS and f != "gpu_seconds_month"}
    out.update(clean_limits(limits))
    if "gpu_seconds_month" in values:
        v = values["gpu_seconds_month"]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 10**15):
            raise KeyInputError("gpu_seconds_month must be a whole number of at least 1, or empty for unlimited.")
        out["gpu_seconds_month"] = v
    unknown = set(values) - {"name", "slug", *TEAM_LIMIT_FIELDS}
    if unknown:
        raise KeyInputError(f"unknown team field {sorted(unknown)[0]!r}")
    return out


def create_team(*, name: str, slug: str | None = None, **limits) -> Team:
    """A team; KeyInputError for a bad field or a name or slug taken."""
    fields = clean_team({"name": name, "slug": slug, **limits})
    if Team.objects.filter(slug=fields["slug"]).exists() or Team.objects.filter(name=fields["name"]).exists():
        raise KeyInputError(f"a team named {fields['name']!r} or with slug {fields['slug']!r} exists already.")
    return Team.objects.create(**fields)


def update_team(*, team: Team, **changes) -> list[str]:
    """Change a team's name, slug or limits; the names of what changed. Its keys' cached limits are
    dropped in every process (the proxy reads the new ones at the next request)."""
    fields = clean_team(changes)
    for field in ("name", "slug"):
        if field in fields and Team.objects.filter(**{field: fields[field]}).exclude(pk=team.pk).exists():
            raise KeyInputError(f"another team has the {field} {fields[field]!r}.")
    changed = [f for f, v in fields.items() if getattr(team, f) != v]
    for field in changed:
        setattr(team, field, fields[field])
    if changed:
        team.save(update_fields=changed)
        notify_changed("keys")
    return changed


def delete_team(*, team: Team) -> int:
    """Delete a team: its memberships go, its keys stay (without a team, so without its limits).
    Returns how many keys it owned."""
    keys = team.api_keys.count()
    team.delete()
    notify_changed("keys")
    return keys


def add_member(*, team: Team, user: User, is_lead: bool = False) -> tuple[TeamMembership, bool]:
    """Put `user` in `team` as a local member (an IdP membership becomes local: the console keeps it
    whatever the groups say); (membership, created)."""
    membership, created = TeamMembership.objects.get_or_create(
        team=team, user=user, defaults={"source": MembershipSource.LOCAL, "is_lead": is_lead})
    if not created and (membership.source != MembershipSource.LOCAL or membership.is_lead != is_lead):
        membership.source, membership.is_lead = MembershipSource.LOCAL, is_lead
        membership.save(update_fields=["source", "is_lead"])
    return membership, created


def remove_member(*, team: Team, user: User) -> bool:
    """Take `user` out of `team` (whatever the source: an IdP one comes back at the next sign-in
    while the groups still say so). False when it was not a member."""
    deleted, _ = TeamMembership.objects.filter(team=team, user=user).delete()
    return bool(deleted)


def set_key_team(*, key: ApiKey, team: Team | None) -> bool:
    """Give a key to a team (or none); True when it changed."""
    if key.team_id == (team.pk if team else None):
        return False
    key.team = team
    key.save(update_fields=["team"])
    notify_changed("keys", key.key_hash)
    return True
