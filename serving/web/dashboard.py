"""The dashboard (the home page): instance states at a glance, the latest events, each node's and
GPU's memory and utilization (hardware.dashboard) and each model's traffic, over 1 h, 24 h or
7 days, from history's samples. Live: the node agents push node panels, every web process pushes
the model charts after its usage flush, and state changes push the states and events."""
from __future__ import annotations

from collections import Counter

from django.template.loader import render_to_string

from hardware.dashboard import node_panels
from history.charts import line_chart
from history.samples import RANGES, ModelSlot, Range, dashboard_group, model_series, percentile
from live.publish import publish, publish_sync
from serving.models import ACTIVE_STATES, InstanceEvent, InstanceState, ModelInstance

RECENT_EVENTS = 12
ACTIVE_SHOWN = 12  # the newest changes; the instances page lists them all
STATES_ID = "dash-states"
MODELS_ID = "dash-models"


def _per_s(slots: list[ModelSlot | None], attr: str, seconds: int) -> list[float | None]:
    return [None if s is None else getattr(s, attr) / seconds for s in slots]


def _quantile(slots: list[ModelSlot | None], hist: str, q: float) -> list[float | None]:
    return [None if s is None else percentile(getattr(s, hist), q) for s in slots]


def model_charts(rng: Range, *, now: float | None = None) -> list[tuple[str, object]]:
    """(caption, svg) per chart: requests/s, tokens/s, latency p50 and p99, TTFT p50, errors/s."""
    times, series = model_series(rng, now=now)
    busiest = sorted(series.values(), key=lambda m: -sum(s.requests for s in m.slots if s))[:7]
    b = rng.bucket_s
    specs = [
        ("Requests", "req/s", lambda m: _per_s(m.slots, "requests", b)),
        ("Generated tokens", "tok/s", lambda m: _per_s(m.slots, "completion_tokens", b)),
        ("Latency p50", "ms", lambda m: _quantile(m.slots, "latency_hist", 0.5)),
        ("Latency p99", "ms", lambda m: _quantile(m.slots, "latency_hist", 0.99)),
        ("Time to first token p50", "ms", lambda m: _quantile(m.slots, "ttft_hist", 0.5)),
        ("Errors", "err/s", lambda m: _per_s(m.slots, "errors", b)),
    ]
    charts = []
    for i, (caption, unit, values) in enumerate(specs):
        data = {m.model: values(m) for m in busiest}
        charts.append((f"{caption} ({unit})", line_chart(
            times=times, series=data, unit=unit, chart_id=f"chart-model-{i}-{rng.name}", step_s=b,
            label=f"{caption} per model, {unit}, last {rng.name}", empty="no requests in this range")))
    return charts


def states_context() -> dict:
    """Counts of instances by state, the active ones, and the latest events."""
    counts = Counter(ModelInstance.objects.values_list("state", flat=True))
    active_qs = ModelInstance.objects.filter(state__in=ACTIVE_STATES)
    active = list(active_qs.select_related("node").only("id", "model_name", "state", "node__name")
                  .order_by("-updated_at")[:ACTIVE_SHOWN])
    events = list(InstanceEvent.objects.select_related("instance").only(
        "at", "from_state", "to_state", "message", "instance__id", "instance__model_name")
        .order_by("-at", "-pk")[:RECENT_EVENTS])
    return {"state_counts": [(s, counts.get(s, 0)) for s in InstanceState.values], "active": active,
            "events": events, "total": sum(counts.values()),
            "active_more": max(0, sum(counts.get(st, 0) for st in ACTIVE_STATES) - len(active))}


def dashboard_context(rng: Range) -> dict:
    return {"range": rng, "ranges": list(RANGES), "panels": node_panels(rng), "model_charts": model_charts(rng),
            **states_context()}


def render_states(*, oob: bool) -> str:
    return render_to_string("serving/partials/_dash_states.html", {**states_context(), "oob": oob})


def render_models(rng: Range, *, oob: bool) -> str:
    return render_to_string("serving/partials/_dash_models.html",
                            {"model_charts": model_charts(rng), "range": rng, "oob": oob})


def states_changed() -> None:
    """After an instance's state changed: the states and events on every open dashboard (sync)."""
    html = render_states(oob=True)
    for name in RANGES:
        publish_sync(dashboard_group(name), html, key=STATES_ID)


async def publish_models() -> None:
    """After a usage flush wrote model slots: the model charts on every open dashboard."""
    from live.db import run_db

    for rng in RANGES.values():
        html = await run_db(render_models, rng, oob=True)
        await publish(dashboard_group(rng.name), html, key=MODELS_ID)

