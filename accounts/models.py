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
    ADMIN = "admin", "Admin"
    OPERATOR = "operator", "Operator"
    VIEWER = "viewer", "Viewer"


ROLE_RANK = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.ADMIN: 2}


class ConsoleUserManager(UserManager):
    def create_superuser(self, username, email=None, password=None, **extra_fields):
        # A superuser is an admin by role too, so the Users page shows (and can change) what it is.
        extra_fields.setdefault("role", Role.ADMIN)
        return super().create_superuser(username, email, password, **extra_fields)


class User(AbstractUser):
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.VIEWER)

    objects = ConsoleUserManager()

    class Meta(AbstractUser.Meta):
        db_table = "xgenconsole_user"  # and so xgenconsole_user_groups, xgenconsole_user_user_permissions

    def has_role(self, needed: str) -> bool:
        """True when this user's role is `needed` or above (admin > operator > viewer)."""
        if not self.is_active:
            return False
        mine = Role.ADMIN if self.is_superuser else self.role
        return ROLE_RANK[Role(mine)] >= ROLE_RANK[Role(needed)]


KEY_PREFIX = "xgen_"
# What a key may do, within its user's role: call models (the proxy, /v1 and /api/inference), read the
# console (every GET of the API and /metrics), change it (every other API write). A new key for an API
# client can be inference-only; keys made before scopes existed have all three (what they could do).
KEY_SCOPES = ("inference", "read", "manage")


def all_scopes() -> list[str]:
    return list(KEY_SCOPES)


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiKey(models.Model):
    """A bearer key; only its SHA-256 is stored, the key itself is shown once."""

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="api_keys")
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
