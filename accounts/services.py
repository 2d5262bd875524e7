"""Writes for users and API keys."""
from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from accounts.credentials import key_cache
from accounts.models import ApiKey, Role, User, hash_key


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


def create_api_key(*, user: User, name: str, expires_at: datetime | None = None) -> tuple[ApiKey, str]:
    """Returns the stored key and the raw key, which is never stored or shown again."""
    raw = ApiKey.generate()
    key = ApiKey.objects.create(
        user=user, name=name or "key", prefix=raw[:12], key_hash=hash_key(raw), expires_at=expires_at
    )
    return key, raw


def revoke_api_key(*, key: ApiKey) -> None:
    """Revoked from now on; this process's key cache forgets it at once, others within the TTL."""
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
    key_cache.clear()
