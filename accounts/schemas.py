"""Schemas of the keys and audit API."""
from __future__ import annotations

from datetime import datetime
from typing import Literal

from ninja import Field, Schema

from accounts.bodies import StrictBody

Scope = Literal["inference", "read", "manage"]  # accounts.models.KEY_SCOPES


class KeyIn(StrictBody):
    name: str = Field(..., min_length=1, max_length=100)
    username: str = Field(..., min_length=1, max_length=150, description="the user the key acts for")
    expires_in_days: int | None = Field(None, ge=1, le=3650)
    allowed_models: list[str] | None = Field(None, description="served names; empty or absent: every model")
    rpm: int | None = Field(None, ge=1, description="requests per minute; absent: unlimited")
    tpm: int | None = Field(None, ge=1, description="tokens per minute (prompt + completion)")
    daily_tokens: int | None = Field(None, ge=1, description="tokens per UTC day")
    monthly_tokens: int | None = Field(None, ge=1, description="tokens per UTC month")
    priority: int | Literal["high", "normal", "low"] | None = Field(
        None, description="high | normal (default) | low, or 0-9 (low 1, normal 4, high 7); higher goes first "
                          "when requests queue")
    scopes: list[Scope] | None = Field(
        None, min_length=1, description="what the key may do within its user's role: inference (the models), "
                                        "read (every GET, /metrics), manage (every other write); absent: all three")


class KeyPatch(StrictBody):
    """Only the fields sent change; null sets a limit (or the expiry) to unlimited."""

    name: str | None = Field(None, min_length=1, max_length=100)
    expires_in_days: int | None = Field(None, ge=1, le=3650, description="from now; null: never expires")
    allowed_models: list[str] | None = None
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    daily_tokens: int | None = Field(None, ge=1)
    monthly_tokens: int | None = Field(None, ge=1)
    priority: int | Literal["high", "normal", "low"] | None = None
    scopes: list[Scope] | None = Field(None, min_length=1, description="null: all three")


class KeyOut(Schema):
    id: int
    name: str
    prefix: str = Field(description="the key's first characters, to recognise it")
    username: str
    role: str
    created_at: datetime
    last_used: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None
    active: bool
    allowed_models: list[str]
    rpm: int | None
    tpm: int | None
    daily_tokens: int | None
    monthly_tokens: int | None
    priority: int
    scopes: list[str]


class KeyCreatedOut(KeyOut):
    key: str = Field(description="the key itself: shown once, only its hash is stored")


class AuditOut(Schema):
    id: int
    time: datetime
    actor: str
    action: str
    target: str
    outcome: str
    client: str
    detail: dict


class AuditPage(Schema):
    items: list[AuditOut]
