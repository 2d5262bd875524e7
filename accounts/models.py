"""Users with a role, and API keys that act for a user.

Both lived in the xgenconsole app up to 0.1.0 and keep its tables (see migrations/0001).
"""
from __future__ import annotations

import hashlib
import secrets

from django.contrib.auth.models import AbstractUser
from django.db import models
from django.utils import timezone


class Role(models.TextChoices):
    ADMIN = "admin", "Admin"
    OPERATOR = "operator", "Operator"
    VIEWER = "viewer", "Viewer"


ROLE_RANK = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.ADMIN: 2}


class User(AbstractUser):
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.VIEWER)

    class Meta(AbstractUser.Meta):
        db_table = "xgenconsole_user"  # and so xgenconsole_user_groups, xgenconsole_user_user_permissions

    def has_role(self, needed: str) -> bool:
        """True when this user's role is `needed` or above (admin > operator > viewer)."""
        if not self.is_active:
            return False
        mine = Role.ADMIN if self.is_superuser else self.role
        return ROLE_RANK[Role(mine)] >= ROLE_RANK[Role(needed)]


KEY_PREFIX = "xgen_"


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

    @classmethod
    def generate(cls) -> str:
        return KEY_PREFIX + secrets.token_urlsafe(32)
