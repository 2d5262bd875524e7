"""Schemas of the keys and audit API."""
from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

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
    team: str | None = Field(None, max_length=50, description="the slug of the team that owns the key; its limits "
                                                              "apply on top of the key's")


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
    team: str | None = Field(None, max_length=50, description="a team's slug; null: no team")


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
    team: str | None = Field(None, description="the slug of the team that owns the key")
    team_id: int | None = None


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
    detail: dict[str, Any]


class AuditPage(Schema):
    items: list[AuditOut]


class TeamIn(StrictBody):
    name: str = Field(..., min_length=1, max_length=100)
    slug: str | None = Field(None, max_length=50, description="a-z, 0-9, - and _; absent: made from the name")
    allowed_models: list[str] | None = Field(None, description="served names every key of the team is limited to")
    rpm: int | None = Field(None, ge=1, description="requests per minute, all the team's keys together")
    tpm: int | None = Field(None, ge=1, description="tokens per minute, all the team's keys together")
    daily_tokens: int | None = Field(None, ge=1, description="tokens per UTC day, all the team's keys together")
    monthly_tokens: int | None = Field(None, ge=1, description="tokens per UTC month, all the team's keys together")
    gpu_seconds_month: int | None = Field(None, ge=1, description="GPU-seconds per UTC month, all the team's keys "
                                                                  "together (chargeback's figure): once reached, "
                                                                  "429 team_gpu_budget_exhausted")


class TeamPatch(StrictBody):
    """Only the fields sent change; null sets a limit to unlimited."""

    name: str | None = Field(None, min_length=1, max_length=100)
    slug: str | None = Field(None, min_length=1, max_length=50)
    allowed_models: list[str] | None = None
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    daily_tokens: int | None = Field(None, ge=1)
    monthly_tokens: int | None = Field(None, ge=1)
    gpu_seconds_month: int | None = Field(None, ge=1)


class MemberOut(Schema):
    username: str
    source: str = Field(description="local (given in the console) or idp (from XGEN_SSO_GROUP_TEAMS)")
    is_lead: bool


class TeamOut(Schema):
    id: int
    name: str
    slug: str
    created_at: datetime
    allowed_models: list[str]
    rpm: int | None
    tpm: int | None
    daily_tokens: int | None
    monthly_tokens: int | None
    gpu_seconds_month: int | None
    members: list[MemberOut]
    keys: int = Field(description="how many keys the team owns (revoked ones included)")


class MemberIn(StrictBody):
    username: str = Field(..., min_length=1, max_length=150)
    is_lead: bool = False


class TeamKeyIn(StrictBody):
    """A key for the team, made by an admin or the team's lead: it acts for `username` (a member;
    absent: the caller), and is inference-only unless `scopes` say otherwise."""

    name: str = Field(..., min_length=1, max_length=100)
    username: str | None = Field(None, min_length=1, max_length=150)
    expires_in_days: int | None = Field(None, ge=1, le=3650)
    allowed_models: list[str] | None = None
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    daily_tokens: int | None = Field(None, ge=1)
    monthly_tokens: int | None = Field(None, ge=1)
    scopes: list[Scope] | None = Field(None, min_length=1, description="absent: inference only")
