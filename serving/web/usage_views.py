"""Pages: Usage (requests, tokens and GPU-seconds over time, per model and per key or user, with a
table, CSV export and a time range) and Requests (the request log with filters and a search by
request id). Both are aggregated and paginated on the server."""
from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta
from urllib.parse import urlencode

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from accounts.errors import ApiError
from accounts.query import query_int
from history.charts import stacked_bars
from serving.proxy.chargeback import chargeback
from serving.proxy.usage import request_rows, usage_rows
from serving.web.usage_api import team_scope, time_range

QUICK_RANGES = {"24h": timedelta(days=1), "7d": timedelta(days=7), "30d": timedelta(days=30)}
MAX_BARS = 24 * 31
REQUESTS_PAGE = 100


def _buckets(start: datetime, end: datetime, step: timedelta) -> list[datetime]:
    first = start.replace(minute=0, second=0, microsecond=0)
    if step >= timedelta(days=1):
        first = first.replace(hour=0)
    out = []
    t = first
    while t < end and len(out) <= MAX_BARS:
        out.append(t)
        t += step
    return out


def _series(rows: list[dict], who, value, index: dict[datetime, int], size: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(lambda: [0.0] * size)
    for row in rows:
        i = index.get(row["bucket_start"])
        if i is not None:
            out[who(row)][i] += value(row)
    return dict(out)


def _team_label(row: dict) -> str:
    return row.get("team") or "(no team)"


def _team_scope(request: HttpRequest, team: str) -> set[int] | None:
    """The teams whose rows a page shows (a team's, or a team lead's teams'; None: all); 404 for a
    team not readable."""
    try:
        return team_scope(request, team or None)
    except ApiError as exc:
        raise Http404(str(exc)) from None


def _key_label(row: dict) -> str:
    if not row.get("key_id"):
        return "(browser session)"
    return row.get("key_name") or f"key {row['key_id']}"


IDLE_ROWS = 20  # the most idle instances; all 200 rows were half of the page's 87 ms (bench/pages.py)


@require_GET
def usage_page(request: HttpRequest) -> HttpResponse:
    """Usage over a range: charts per model and per key (or user, or team), a table, and CSV export;
    `team=` narrows it to a team's keys, and a team lead's page to its teams' keys."""
    error = None
    quick = request.GET.get("range", "")
    group = request.GET.get("group", "key") if request.GET.get("group") in ("key", "user", "team") else "key"
    team = request.GET.get("team", "").strip()[:50]
    team_ids = _team_scope(request, team)
    try:
        if quick in QUICK_RANGES:
            start, end = time_range(None, None, default=QUICK_RANGES[quick])
        else:
            start, end = time_range(request.GET.get("from") or None, request.GET.get("to") or None)
    except ApiError as exc:
        error = exc.message
        start, end = time_range(None, None)
    bucket = request.GET.get("bucket") or ("hour" if end - start <= timedelta(days=3) else "day")
    if bucket not in ("hour", "day") or (bucket == "hour" and end - start > timedelta(days=31)):
        bucket = "day"
    step = timedelta(hours=1) if bucket == "hour" else timedelta(days=1)
    axis = _buckets(start, end, step)
    index = {t: i for i, t in enumerate(axis)}
    fmt = "%m-%d %H:00" if bucket == "hour" else "%Y-%m-%d"
    labels = [t.strftime(fmt) for t in axis]
    by_model = usage_rows(start=start, end=end, group_by="model", bucket=bucket, team_ids=team_ids)
    by_who = usage_rows(start=start, end=end, group_by=group, bucket=bucket, team_ids=team_ids)
    who = _key_label if group == "key" else (_team_label if group == "team" else (lambda r: r.get("user") or "(no user)"))
    tokens = lambda r: r["prompt_tokens"] + r["completion_tokens"]  # noqa: E731
    charge = chargeback(start=start, end=end, group_by=group, per_hour=True, team_ids=team_ids)
    names = {i["key_id"]: i["key_name"] for i in charge["items"]} if group == "key" else {}
    team_names = {i["team_id"] or 0: _team_label(i) for i in charge["items"]} if group == "team" else {}
    gpu_series: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(axis))
    for hour, per in charge["series"].items():
        moment = datetime.fromtimestamp(hour, tz=UTC)
        if bucket == "day":
            moment = moment.replace(hour=0)
        i = index.get(moment)
        if i is None:
            continue
        for w, gs in per.items():
            if group == "team":  # the series is per team id (0: no team)
                label = w if w == "(idle)" else team_names.get(w, "(no team)")
            else:
                label = w if w == "(idle)" else (_key_label({"key_id": w, "key_name": names.get(w)}) if group == "key"
                                                 else (w or "(no user)"))
            gpu_series[label][i] += gs
    charts = [
        ("Requests per model", stacked_bars(label="Requests per model", labels=labels, series=_series(by_model, lambda r: r["model"],
                                                                          lambda r: r["requests"], index, len(axis)),
                                            unit="requests", chart_id="chart-requests-model")),
        ("Tokens per model", stacked_bars(label="Tokens per model", labels=labels, series=_series(by_model, lambda r: r["model"], tokens, index,
                                                                        len(axis)),
                                          unit="tokens", chart_id="chart-tokens-model")),
        (f"Requests per {group}", stacked_bars(label=f"Requests per {group}", labels=labels, series=_series(by_who, who, lambda r: r["requests"],
                                                                             index, len(axis)),
                                               unit="requests", chart_id="chart-requests-who")),
        (f"Tokens per {group}", stacked_bars(label=f"Tokens per {group}", labels=labels, series=_series(by_who, who, tokens, index, len(axis)),
                                             unit="tokens", chart_id="chart-tokens-who")),
        (f"GPU-seconds per {group} (grey: idle)", stacked_bars(label=f"GPU-seconds per {group} (grey: idle)", labels=labels, series=dict(gpu_series),
                                                               unit="GPU-s", chart_id="chart-gpu-who")),
    ]
    totals: dict[str, dict] = {}
    for row in by_who:
        t = totals.setdefault(who(row), {"name": who(row), "requests": 0, "errors": 0, "prompt_tokens": 0,
                                         "completion_tokens": 0, "busy_seconds": 0.0, "gpu_seconds": 0.0,
                                         "share": 0.0})
        for f in ("requests", "errors", "prompt_tokens", "completion_tokens", "busy_seconds"):
            t[f] += row[f]
    for item in charge["items"]:
        name = _key_label(item) if group == "key" else (
            _team_label(item) if group == "team" else (item["user"] or "(no user)"))
        t = totals.setdefault(name, {"name": name, "requests": 0, "errors": 0, "prompt_tokens": 0,
                                     "completion_tokens": 0, "busy_seconds": 0.0, "gpu_seconds": 0.0, "share": 0.0})
        t["gpu_seconds"] += item["gpu_seconds"]
        t["share"] += item["share"]
    table = sorted(totals.values(), key=lambda t: (-t["gpu_seconds"], -t["requests"], t["name"]))
    params = {"from": start.isoformat(), "to": end.isoformat(), "group_by": group, "bucket": bucket, "format": "csv",
              **({"team": team} if team else {})}
    ctx = {
        "error": error, "charts": charts, "table": table, "idle": charge["idle"][:IDLE_ROWS],
        "idle_count": len(charge["idle"]), "group": group, "bucket": bucket,
        "chargeback_url": "/api/usage/chargeback?" + urlencode({"from": start.isoformat(), "to": end.isoformat(),
                                                                "group_by": group, **({"team": team} if team else {})}),
        "team": team,
        "start": start, "end": end, "quick": quick, "total_gpu_seconds": charge["total_gpu_seconds"],
        "from_value": start.strftime("%Y-%m-%dT%H:%M"), "to_value": end.strftime("%Y-%m-%dT%H:%M"),
        "csv_url": "/api/usage?" + urlencode(params), "quick_ranges": list(QUICK_RANGES),
    }
    return render(request, "serving/usage.html", ctx)


@require_GET
def requests_page(request: HttpRequest) -> HttpResponse:
    """The request log: newest first, filtered by key, model and status, or one request by its id."""
    from serving.proxy.replicas import routing_table

    key = request.GET.get("key", "").strip()[:100]
    model = request.GET.get("model", "").strip()[:255]
    status = query_int(request.GET, "status", minimum=100, maximum=599)
    request_id = request.GET.get("request_id", "").strip()[:128]
    before = query_int(request.GET, "before", minimum=1)
    team = request.GET.get("team", "").strip()[:50]
    team_ids = _team_scope(request, team)
    rows = request_rows(key=key or None, model=model or None, status=status, request_id=request_id or None,
                        before=before, limit=REQUESTS_PAGE + 1, team_ids=team_ids)
    older = rows[REQUESTS_PAGE - 1]["id"] if len(rows) > REQUESTS_PAGE else None
    filters = {"key": key, "model": model, "status": str(status) if status else "", "request_id": request_id,
               "team": team}
    in_flight = ([(b.model_name, b.instance_id, b.node, b.in_flight) for b in routing_table.backends() if b.in_flight]
                 if team_ids is None else [])  # every tenant's: not for a team's view
    ctx = {"rows": rows[:REQUESTS_PAGE], "older": older, "filters": filters,
           "older_url": "?" + urlencode({**{k: v for k, v in filters.items() if v}, "before": older}) if older else "",
           "in_flight": in_flight}
    template = "serving/partials/_request_rows.html" if request.htmx else "serving/requests.html"
    return render(request, template, ctx)
