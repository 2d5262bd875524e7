"""Usage, chargeback and the request log (mounted at /api/usage and /api/requests; viewer+), by key,
user, model, node or team (`team=` a slug narrows any of them to what the team's keys used while the
team owned them; a team lead below operator reads its teams' only)."""
from __future__ import annotations

from datetime import UTC, datetime, time, timedelta
from typing import Literal

from django.http import HttpRequest, HttpResponse
from django.utils.dateparse import parse_date, parse_datetime
from ninja import Field, Query, Router, Schema

from accounts.auth import api_auth, visible_models
from accounts.errors import ApiError
from accounts.models import Team
from accounts.spreadsheet import csv_text
from serving.proxy.chargeback import chargeback
from serving.proxy.usage import request_rows, usage_rows

usage_router = Router()
requests_router = Router()

MAX_RANGE = timedelta(days=400)
CSV_FIELDS = ("bucket_start", "key_id", "key_name", "team", "user", "model", "node", "instance_id", "requests", "errors",
              "prompt_tokens", "completion_tokens", "busy_seconds")


def parse_moment(value: str | None, *, name: str, end: bool = False) -> datetime | None:
    """An ISO date or date-time (UTC unless it says otherwise); a date alone is its midnight
    (for `to`, the next midnight: the whole day is in). ApiError 400 otherwise."""
    if value is None or value == "":
        return None
    try:
        moment = parse_datetime(value)
        if moment is None:
            day = parse_date(value)
            if day is None:
                raise ValueError(value)
            moment = datetime.combine(day + timedelta(days=1) if end else day, time(), tzinfo=UTC)
    except (ValueError, OverflowError):
        raise ApiError(400, f"`{name}` must be an ISO date or date-time, e.g. 2026-11-30 or "
                            f"2026-11-30T14:00:00Z.", code="invalid_request") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment


def time_range(start: str | None, end: str | None, *, default: timedelta = timedelta(days=1)
               ) -> tuple[datetime, datetime]:
    """[from, to) with defaults (the last day up to now); ApiError 400 for a bad or huge range."""
    to = parse_moment(end, name="to", end=True) or datetime.now(tz=UTC)
    since = parse_moment(start, name="from") or to - default
    if since >= to:
        raise ApiError(400, "`from` must be before `to`.", code="invalid_request")
    if to - since > MAX_RANGE:
        raise ApiError(400, f"The range may span at most {MAX_RANGE.days} days.", code="invalid_request")
    return since, to


def team_scope(request: HttpRequest, team: str | None) -> set[int] | None:
    """The teams whose rows a call reads (rows name the team that owned the key when it was used):
    `team` (a slug) if named, and a team lead's reads (below operator) are held to the teams it
    leads whatever it asks; None: every row. A team the caller may not read answers 404, as one
    that does not exist."""
    user = getattr(request, "auth", None) or request.user
    scope = user.team_scope()
    team_ids = scope
    if team:
        found = Team.objects.filter(slug=team).values_list("pk", flat=True).first()
        if found is None or (scope is not None and found not in scope):
            raise ApiError(404, f"No team {team!r}.", code="team_not_found")
        team_ids = {found}
    return None if team_ids is None else set(team_ids)


class UsageQuery(Schema):
    start: str | None = Field(None, alias="from", description="ISO date or date-time (UTC); default: a day before `to`")
    end: str | None = Field(None, alias="to", description="ISO date or date-time (UTC); default: now")
    group_by: Literal["key", "user", "model", "node", "team"] = "key"
    bucket: Literal["hour", "day"] = "hour"
    format: Literal["json", "csv"] = "json"
    key: int | None = Field(None, ge=0, description="only this key id")
    model: str | None = Field(None, max_length=255)
    team: str | None = Field(None, max_length=50, description="only what this team's (a slug) keys used while it owned them")


class UsageItem(Schema):
    bucket_start: datetime
    key_id: int | None = None
    key_name: str | None = None
    user: str | None = None
    model: str | None = None
    node: str | None = None
    team: str | None = None
    team_id: int | None = None
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    busy_seconds: float


class UsageOut(Schema):
    items: list[UsageItem]


@usage_router.get("", response=UsageOut, auth=api_auth, summary="Usage per hour or day, by key, user, model or node")
def usage(request: HttpRequest, query: Query[UsageQuery]):
    """Requests, errors, tokens and busy seconds from the usage buckets every web process writes
    (at least every XGEN_USAGE_FLUSH seconds). `format=csv` answers text/csv."""
    start, end = time_range(query.start, query.end)
    rows = usage_rows(start=start, end=end, group_by=query.group_by, bucket=query.bucket, key_id=query.key,
                      model=query.model, models=visible_models(request), team_ids=team_scope(request, query.team))
    if query.format == "csv":
        fields = [f for f in CSV_FIELDS if any(f in r for r in rows)] or CSV_FIELDS
        text = csv_text(fields, ({**row, "bucket_start": row["bucket_start"].isoformat()} for row in rows))
        response = HttpResponse(text, content_type="text/csv; charset=utf-8")
        name = f"usage-{query.group_by}-{start:%Y%m%dT%H%M}-{end:%Y%m%dT%H%M}.csv"
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response
    return {"items": rows}


class ChargebackQuery(Schema):
    start: str | None = Field(None, alias="from")
    end: str | None = Field(None, alias="to")
    group_by: Literal["key", "user", "team"] = "key"
    team: str | None = Field(None, max_length=50, description="only what this team's (a slug) keys used while it owned them")


class ChargeItem(Schema):
    key_id: int | None = None
    key_name: str | None = None
    user: str | None = None
    team: str | None = None
    team_id: int | None = None
    gpu_seconds: float
    busy_seconds: float
    share: float = Field(description="of every READY GPU-second in the range, idle included")


class IdleItem(Schema):
    instance_id: int
    model: str
    node: str
    gpus: int
    gpu_seconds: float
    share: float


class ChargebackOut(Schema):
    start: datetime = Field(alias="from")
    end: datetime = Field(alias="to")
    group_by: str
    total_gpu_seconds: float
    items: list[ChargeItem]
    idle: list[IdleItem]


@usage_router.get("/chargeback", response=ChargebackOut, by_alias=True, auth=api_auth,
                  summary="GPU-seconds per key or user, and idle per instance")
def usage_chargeback(request: HttpRequest, query: Query[ChargebackQuery]):
    """Each instance's READY time x its GPU count (a CPU instance counts as one), split across the
    keys that used it in each hour by their busy seconds; the unused part is idle, per instance.
    Not for a key with allowed_models: the split is of every tenant's keys and instances."""
    if visible_models(request) is not None:
        raise ApiError(403, "Chargeback covers every key and instance: a key with allowed_models cannot read it.",
                       code="model_limited_key")
    start, end = time_range(query.start, query.end)
    teams = team_scope(request, query.team)
    if teams is not None and query.group_by == "user":
        raise ApiError(400, "A team's chargeback is by key or team.", code="invalid_request")
    return chargeback(start=start, end=end, group_by=query.group_by, team_ids=teams)


class RequestsQuery(Schema):
    key: str | None = Field(None, max_length=100, description="a key id or a key name")
    model: str | None = Field(None, max_length=255)
    status: int | None = Field(None, ge=100, le=599)
    request_id: str | None = Field(None, max_length=128, description="the console's id or the caller's X-Request-ID")
    before: int | None = Field(None, ge=1, description="only rows with a smaller id (older pages)")
    limit: int = Field(100, ge=1, le=1000)
    team: str | None = Field(None, max_length=50, description="only what this team's (a slug) keys used while it owned them")


class RequestItem(Schema):
    id: int
    time: datetime
    request_id: str
    key_id: int | None
    key_name: str
    team: str | None = Field(None, description="the team that owned the key when the request was made")
    user: str
    model: str
    instance_id: int | None
    node: str
    status: int
    error: str | None
    ttft_ms: float | None
    duration_ms: float | None
    prompt_tokens: int
    completion_tokens: int
    stream: bool
    client: str
    client_request_id: str = Field("", description="the caller's X-Request-ID ('' when it sent none)")
    usage_source: str = Field("engine", description="who counted the tokens: `engine` (its own usage) or `console` "
                                                  "(the engine's count of the prompt, the tokens streamed)")
    resumes: int = Field(0, description="times the stream went on on another replica after its own broke")


class RequestsOut(Schema):
    items: list[RequestItem]


@requests_router.get("", response=RequestsOut, auth=api_auth, summary="The request log, newest first")
def requests_log(request: HttpRequest, query: Query[RequestsQuery]):
    """One row per proxied request (never its prompt or answer), kept XGEN_REQUEST_LOG_DAYS days.
    A key with allowed_models reads its models' rows only, and other users' client addresses blank."""
    models = visible_models(request)
    rows = request_rows(key=query.key, model=query.model, status=query.status, request_id=query.request_id,
                        before=query.before, limit=query.limit, models=models,
                        team_ids=team_scope(request, query.team))
    if models is not None:
        for row in rows:
            if row["user"] != request.user.username:
                row["client"] = ""
    return {"items": rows}
