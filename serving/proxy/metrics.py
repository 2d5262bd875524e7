"""Inference usage: Prometheus metrics (exported at /metrics) and an in-process summary.

Per model and instance: requests, errors, latency and tokens from the backend's `usage`.
The summary is this process's view (each web process counts its own traffic).
"""
from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest

REQUESTS = Counter(
    "xgen_inference_requests", "Inference requests answered by a backend",
    ["model", "instance", "status"],
)
ERRORS = Counter(
    "xgen_inference_errors", "Inference requests that failed (upstream error status or a broken connection)",
    ["model", "instance", "reason"],
)
REJECTED = Counter(
    "xgen_inference_rejected", "Inference requests the proxy answered itself (auth, bad body, no backend)",
    ["code"],
)
LATENCY = Histogram(
    "xgen_inference_duration_seconds", "Time from request to the last byte of the answer",
    ["model", "instance"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
FIRST_BYTE = Histogram(
    "xgen_inference_first_byte_seconds", "Time from request to the backend's response headers",
    ["model", "instance"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
PROXY_TIME = Histogram(
    "xgen_inference_proxy_seconds", "Time spent in the console on a proxied answer (Server-Timing's proxy;dur)",
    ["model", "instance"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
UPSTREAM_TIME = Histogram(
    "xgen_inference_upstream_seconds", "Time to the backend's first byte (Server-Timing's upstream;dur)",
    ["model", "instance"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
TOKENS = Counter(
    "xgen_inference_tokens", "Tokens reported by the backend's usage", ["model", "instance", "kind"],
)
# On-demand models (this process's requests; idle unloads and evictions are in the fleet families).
COLD_STARTS = Counter("xgen_cold_starts", "Cold starts of on_demand models begun by this process's requests",
                      ["model"])
COLD_START_FAILED = Counter("xgen_cold_starts_failed", "Cold starts that did not reach READY", ["model"])
COLD_START_SECONDS = Histogram(
    "xgen_cold_start_seconds", "From a cold start's request to READY", ["model"],
    buckets=(0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900, 1800))
QUEUE_DEPTH = Gauge("xgen_queue_depth", "Requests waiting for a slot of a model at max_concurrency", ["model"])
QUEUE_WAIT = Histogram(
    "xgen_queue_wait_seconds", "Time a request waited in its model's queue", ["model"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
STREAM_RESUMES = Counter(
    "xgen_stream_resumes", "Streams that went on on another replica after theirs broke (outcome: resumed, "
    "or why not: no_replica, not_resumable, limit, failed)", ["model", "outcome"])
QUEUE_REJECTED = Counter("xgen_queue_rejected", "Requests refused with 429 queue_full", ["model"])
ADMISSION_REDIS_FALLBACK = Counter(
    "xgen_admission_redis_fallback",
    "Requests admitted by this process's own queue (or refused) because Redis failed (cluster mode)", ["mode"])



class InFlightCollector:
    """`xgen_inference_in_flight{model,instance}`: requests open to each backend now (this process)."""

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        from serving.proxy.replicas import routing_table

        family = GaugeMetricFamily("xgen_inference_in_flight", "Requests open to a backend now",
                                   labels=["model", "instance"])
        for backend in routing_table.backends():
            family.add_metric([backend.model_name, str(backend.instance_id)], backend.in_flight)
        yield family

    def describe(self):
        return []


REGISTRY.register(InFlightCollector())

RECENT = 512  # latencies kept per instance for the summary's percentiles
CLIENT_GONE = 499  # recorded for a client that left mid-answer: not the backend's error


@dataclass
class InstanceUsage:
    """Usage of one instance as seen by this process."""

    model: str
    instance_id: int
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_sum_s: float = 0.0
    first_byte_sum_s: float = 0.0
    first_byte_count: int = 0
    last_at: float = 0.0
    recent_s: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    series: dict = field(default_factory=dict)  # labelled Prometheus children, looked up once

    def __post_init__(self) -> None:
        inst = str(self.instance_id)
        self.series.update(
            latency=LATENCY.labels(self.model, inst), first_byte=FIRST_BYTE.labels(self.model, inst),
            prompt=TOKENS.labels(self.model, inst, "prompt"), completion=TOKENS.labels(self.model, inst, "completion"),
            proxy=PROXY_TIME.labels(self.model, inst), upstream=UPSTREAM_TIME.labels(self.model, inst),
        )


_usage: dict[tuple[str, int], InstanceUsage] = {}
_lock = threading.Lock()


def _usage_of(model: str, instance_id: int) -> InstanceUsage:
    with _lock:
        usage = _usage.get((model, instance_id))
        if usage is None:
            usage = _usage[(model, instance_id)] = InstanceUsage(model=model, instance_id=instance_id)
    return usage


def record(*, model: str, instance_id: int, status: int, duration_s: float, first_byte_s: float | None,
           prompt_tokens: int = 0, completion_tokens: int = 0, error: str | None = None) -> None:
    """Count one request that reached a backend."""
    usage = _usage_of(model, instance_id)
    series = usage.series
    requests = series.get(status)
    if requests is None:
        requests = series[status] = REQUESTS.labels(model, str(instance_id), str(status))
    requests.inc()
    series["latency"].observe(duration_s)
    if first_byte_s is not None:
        series["first_byte"].observe(first_byte_s)
    failed = error is not None or (status >= 400 and status != CLIENT_GONE)
    if failed:
        ERRORS.labels(model, str(instance_id), error or f"status_{status}").inc()
    if prompt_tokens:
        series["prompt"].inc(prompt_tokens)
    if completion_tokens:
        series["completion"].inc(completion_tokens)
    with _lock:
        usage.requests += 1
        usage.errors += int(failed)
        usage.prompt_tokens += prompt_tokens
        usage.completion_tokens += completion_tokens
        usage.latency_sum_s += duration_s
        if first_byte_s is not None:
            usage.first_byte_sum_s += first_byte_s
            usage.first_byte_count += 1
        usage.last_at = time.time()
        usage.recent_s.append(duration_s)


def record_timing(*, model: str, instance_id: int, proxy_s: float, upstream_s: float) -> None:
    """The two Server-Timing figures of one proxied answer."""
    series = _usage_of(model, instance_id).series
    series["proxy"].observe(proxy_s)
    series["upstream"].observe(upstream_s)


def record_rejected(code: str) -> None:
    """Count a request the proxy answered without a backend."""
    REJECTED.labels(code).inc()


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def usage_summary(*, instance_id: int | None = None, model: str | None = None) -> list[dict]:
    """Rows for the instance page: requests, errors, tokens and latency (ms) per model and instance,
    plus the requests in flight now (this process's counts)."""
    from serving.proxy.replicas import routing_table

    in_flight = routing_table.in_flight_by_instance()
    with _lock:
        items = [
            (u, list(u.recent_s)) for u in _usage.values()
            if (instance_id is None or u.instance_id == instance_id) and (model is None or u.model == model)
        ]
    rows = []
    for u, recent in sorted(items, key=lambda item: (item[0].model, item[0].instance_id)):
        p50, p99 = _percentile(recent, 0.5), _percentile(recent, 0.99)
        rows.append({
            "model": u.model,
            "instance_id": u.instance_id,
            "requests": u.requests,
            "errors": u.errors,
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "in_flight": in_flight.get(u.instance_id, 0),
            "mean_ms": round(1000 * u.latency_sum_s / u.requests, 1) if u.requests else None,
            "first_byte_ms": (round(1000 * u.first_byte_sum_s / u.first_byte_count, 1)
                              if u.first_byte_count else None),
            "p50_ms": round(1000 * p50, 1) if p50 is not None else None,
            "p99_ms": round(1000 * p99, 1) if p99 is not None else None,
            "last_at": datetime.fromtimestamp(u.last_at, tz=UTC) if u.last_at else None,
        })
    return rows


MODEL_LABEL_RE = re.compile(rb'[{,]model="((?:[^"\\]|\\.)*)"')


def only_models(text: bytes, models: frozenset[str]) -> bytes:
    """The exposition less every sample labelled with a model outside `models` (a key limited by
    allowed_models reads its own models' figures, not other tenants'); samples without a model
    label, HELP and TYPE lines stay."""
    allowed = {m.encode().replace(b"\\", b"\\\\").replace(b'"', b'\\"').replace(b"\n", b"\\n") for m in models}
    kept = []
    for line in text.split(b"\n"):
        if not line.startswith(b"#"):
            found = MODEL_LABEL_RE.search(line)  # a raw quote never stands inside a label value
            if found is not None and found.group(1) not in allowed:
                continue
        kept.append(line)
    return b"\n".join(kept)


def render_metrics() -> tuple[bytes, str]:
    """The Prometheus text exposition of this process, and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST

