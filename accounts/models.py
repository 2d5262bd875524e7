"""Users with a role, API keys that act for a user (with their limits), and the audit log.

Users and keys lived in the xgenconsole app up to 0.1.0 and keep its tables (see migrations/0001).
"""
from __future__ import annotations

import hashlib
import secrets

from django.contrib.auth.models import AbstractUser, UserManager
from django.db import models
from django.utils import timezone


class Role(models.TextChoices):
    # Each member is its str value at run time (Django's enum metaclass); Django ships no types,
    # so without the annotation a type checker takes the (value, label) tuple for the member.
    ADMIN: str = "admin", "Admin"  # type: ignore[assignment]
    OPERATOR: str = "operator", "Operator"  # type: ignore[assignment]
    VIEWER: str = "viewer", "Viewer"  # type: ignore[assignment]


ROLE_RANK = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.ADMIN: 2}


def effective_role(*roles: str) -> str:
    """The highest of `roles` (empty ones ignored); viewer when none is set."""
    given = [Role(r) for r in roles if r]
    return max(given, key=ROLE_RANK.__getitem__) if given else Role.VIEWER


class ConsoleUserManager(UserManager):
    def _create_user(self, username, email, password, **extra_fields):
        # A user made in the console (page, createuser, ensureadmin) holds its role locally.
        extra_fields.setdefault("local_role", extra_fields.get("role", Role.VIEWER))
        return super()._create_user(username, email, password, **extra_fields)

    def create_superuser(self, username, email=None, password=None, **extra_fields):
        # A superuser is an admin by role too, so the Users page shows (and can change) what it is.
        extra_fields.setdefault("role", Role.ADMIN)
        return super().create_superuser(username, email, password, **extra_fields)


class IdpSource(models.TextChoices):
    LOCAL = "", "Local"
    OIDC = "oidc", "OpenID Connect"
    LDAP = "ldap", "LDAP"


class User(AbstractUser):
    # The effective role: the higher of local_role (set here, on the Users page) and idp_role (from
    # the identity provider's groups, accounts.sso); a sync changes only idp_role.
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.VIEWER)
    local_role = models.CharField(max_length=16, choices=Role.choices, blank=True, default="",
                                  help_text="the role given in the console; empty: none (an SSO user)")
    # Where the user signs in: local (password), OIDC or LDAP. SSO users have no usable password.
    idp_source = models.CharField(max_length=8, choices=IdpSource.choices, blank=True, default="")
    idp_subject = models.CharField(max_length=255, blank=True, default="", help_text="OIDC sub, or LDAP DN")
    idp_groups = models.JSONField(null=True, blank=True, help_text="the groups at the last sync; null: never sent")
    idp_role = models.CharField(max_length=16, choices=Role.choices, blank=True, default="",
                                help_text="the role the groups map to (XGEN_SSO_GROUP_ROLES); empty: none")
    idp_synced_at = models.DateTimeField(null=True, blank=True)

    objects = ConsoleUserManager()

    class Meta(AbstractUser.Meta):
        db_table = "xgenconsole_user"  # and so xgenconsole_user_groups, xgenconsole_user_user_permissions
        constraints = [models.UniqueConstraint(fields=["idp_source", "idp_subject"], condition=~models.Q(idp_source=""),
                                               name="user_idp_subject_unique")]

    def has_role(self, needed: str) -> bool:
        """True when this user's role is `needed` or above (admin > operator > viewer)."""
        if not self.is_active:
            return False
        mine = Role.ADMIN if self.is_superuser else self.role
        return ROLE_RANK[Role(mine)] >= ROLE_RANK[Role(needed)]

    def team_scope(self) -> set[int] | None:
        """The teams a team lead is limited to: a lead whose role is below operator reads the usage,
        request log and keys of the teams it leads, and nothing of other teams. None: not limited
        (an operator or admin reads everything; a viewer that leads no team, as before teams)."""
        if self.has_role(Role.OPERATOR):
            return None
        led = set(self.team_memberships.filter(is_lead=True).values_list("team_id", flat=True))
        return led or None

    def leads(self, team_id: int) -> bool:
        """Whether this user may manage `team_id`'s keys: an admin, or the team's lead."""
        return self.has_role(Role.ADMIN) or (
            self.is_active and self.team_memberships.filter(team_id=team_id, is_lead=True).exists())


KEY_PREFIX = "xgen_"
# What a key may do, within its user's role: call models (the proxy, /v1 and /api/inference), read the
# console (every GET of the API and /metrics), change it (every other API write). A new key for an API
# client can be inference-only; keys made before scopes existed have all three (what they could do).
KEY_SCOPES = ("inference", "read", "manage")


def all_scopes() -> list[str]:
    return list(KEY_SCOPES)


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


class Team(models.Model):
    """A group of users that owns keys, with limits and quotas on top of each key's own: the proxy
    counts every key of the team together (rpm, tpm, daily and monthly tokens, GPU-seconds per
    month), and refuses a model the team may not use. Empty (null, []) means unlimited."""

    name = models.CharField(max_length=100, unique=True)
    slug = models.SlugField(max_length=50, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    allowed_models = models.JSONField(default=list, blank=True, help_text="served names; [] = every model")
    rpm = models.PositiveIntegerField(null=True, blank=True, help_text="requests per minute, all keys together")
    tpm = models.PositiveBigIntegerField(null=True, blank=True, help_text="tokens per minute, all keys together")
    daily_tokens = models.PositiveBigIntegerField(null=True, blank=True, help_text="tokens per UTC day")
    monthly_tokens = models.PositiveBigIntegerField(null=True, blank=True, help_text="tokens per UTC month")
    gpu_seconds_month = models.PositiveBigIntegerField(
        null=True, blank=True,
        help_text="GPU-seconds per UTC month, all keys together (the proxy refuses the keys once used)")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_limited(self) -> bool:
        return bool(self.allowed_models) or any(
            v is not None for v in (self.rpm, self.tpm, self.daily_tokens, self.monthly_tokens))


class MembershipSource(models.TextChoices):
    LOCAL: str = "local", "Local"  # type: ignore[assignment]
    IDP: str = "idp", "Identity provider"  # type: ignore[assignment]


class TeamMembership(models.Model):
    """A user in a team: given in the console (local) or by the identity provider's groups
    (XGEN_SSO_GROUP_TEAMS, idp). A sign-in's sync adds and removes idp memberships only; a local one
    is never removed by it (and wins: a user already a local member is not made an idp one)."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="team_memberships")
    source = models.CharField(max_length=8, choices=MembershipSource.choices, default=MembershipSource.LOCAL)
    is_lead = models.BooleanField(default=False, help_text="sees and manages the team's keys and usage")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="team_member_unique")]
        ordering = ["team__name", "user__username"]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.source}{', lead' if self.is_lead else ''})"


class ApiKey(models.Model):
    """A bearer key; only its SHA-256 is stored, the key itself is shown once."""

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="api_keys")
    # The team that owns the key: its limits apply on top of the key's own (serving.proxy.admission).
    team = models.ForeignKey(Team, on_delete=models.SET_NULL, null=True, blank=True, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, help_text="first characters, to recognise a key")
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Limits, enforced by the inference proxy; empty (null, []) means unlimited.
    allowed_models = models.JSONField(default=list, blank=True, help_text="served names; [] = every model")
    rpm = models.PositiveIntegerField(null=True, blank=True, help_text="requests per minute")
    tpm = models.PositiveBigIntegerField(null=True, blank=True, help_text="tokens per minute")
    daily_tokens = models.PositiveBigIntegerField(null=True, blank=True, help_text="tokens per UTC day")
    monthly_tokens = models.PositiveBigIntegerField(null=True, blank=True, help_text="tokens per UTC month")
    priority = models.PositiveSmallIntegerField(
        default=4, help_text="0-9, higher goes first when requests queue; low = 1, normal = 4 (default), high = 7")
    scopes = models.JSONField(default=all_scopes, blank=True, help_text="of inference, read, manage")

    class Meta:
        db_table = "xgenconsole_apikey"
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def is_usable(self) -> bool:
        now = timezone.now()
        return (
            self.revoked_at is None
            and (self.expires_at is None or self.expires_at > now)
            and self.user.is_active
        )

    @property
    def masked(self) -> str:
        return f"{self.prefix}…"

    @property
    def is_limited(self) -> bool:
        return any(v is not None for v in (self.rpm, self.tpm, self.daily_tokens, self.monthly_tokens))

    @classmethod
    def generate(cls) -> str:
        return KEY_PREFIX + secrets.token_urlsafe(32)


class AuditOutcome(models.TextChoices):
    SUCCESS = "success"
    REFUSED = "refused"  # not allowed, or the input was refused
    FAILED = "failed"  # allowed, but it did not work


class AuditEvent(models.Model):
    """One change or sign-in, as it happened. Append-only: the application never changes or
    deletes a row (save() refuses updates, delete() refuses), and no route does."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    # The actor's name as it was (the log outlives users; no foreign key), "cli" for commands,
    # or the name typed at a failed sign-in.
    actor = models.CharField(max_length=150, blank=True)
    actor_id = models.IntegerField(null=True, blank=True)
    action = models.CharField(max_length=32, db_index=True)
    target = models.CharField(max_length=300, blank=True)
    outcome = models.CharField(max_length=16, choices=AuditOutcome.choices, default=AuditOutcome.SUCCESS)
    client = models.CharField(max_length=64, blank=True, help_text="client address")
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-pk"]
        indexes = [models.Index(fields=["actor", "at"])]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target} ({self.outcome})"

    def save(self, *args, **kwargs) -> None:
        if not self._state.adding:
            raise PermissionError("audit events are append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise PermissionError("audit events are append-only")
