"""Writing, downsampling and reading the fleet's samples (history.models).

Resolutions: 10 s and 1 min slots kept a day, 5 min slots kept 30 days, 15 min slots kept two
days, 1 h slots kept a year. The node
agents write 10 s rows; `downsample()` (every agent runs it, it is idempotent) rolls finished
windows into the coarser rows and prunes what is past its resolution's retention. A read for a
range takes the coarse rows it has and the finer rows after them, so the newest minutes are
always there, and averages weighted by each row's step.
"""
from __future__ import annotations

import bisect
import json
import threading
import time
from dataclasses import dataclass, field

from django.db import connection, transaction

from history.models import ALL_GPUS, HOST_GPU, ModelSample, ResourceSample

FINE = 10
TIERS = (10, 60, 300, 900, 3600)  # each rolled up from the one before it
# The 1 min and 15 min rows exist for the 1 h and 24 h ranges: a chart reads one row a point
# (reading and summing 6 or 3 rows a point was most of the dashboard's time); they cost little.
RETENTION_S = {10: 86400, 60: 86400, 300: 30 * 86400, 900: 2 * 86400, 3600: 365 * 86400}
LATENCY_BOUNDS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 300000)


@dataclass(frozen=True)
class Range:
    name: str
    seconds: int
    bucket_s: int  # the chart's slot
    tier: int  # the coarsest resolution it reads


# About 60-100 points a chart: enough to read, and the fleet's 40 charts render in a few ms each.
RANGES = {r.name: r for r in (Range("1h", 3600, 60, 60), Range("24h", 86400, 900, 900),
                              Range("7d", 7 * 86400, 7200, 3600))}
DEFAULT_RANGE = "1h"


def dashboard_group(range_name: str) -> str:
    """The live group of the dashboard open on one range."""
    return f"dashboard.{range_name}"


# ---------------------------------------------------------------- writing (node agents)
@dataclass
class ResourceReading:
    gpu: int
    mem_used_mib: int
    mem_total_mib: int
    mem_alloc_mib: int = 0
    util_pct: float | None = None


def record_resources(*, node: str, readings: list[ResourceReading], at: float | None = None) -> int:
    """Store one 10 s sample per reading (a second sample in the same slot replaces the first),
    and with GPUs the node's summary row (memory summed, utilization averaged)."""
    slot = int((at if at is not None else time.time()) // FINE * FINE)
    gpus = [r for r in readings if r.gpu >= 0]
    if gpus:
        utils = [r.util_pct for r in gpus if r.util_pct is not None]
        readings = [*readings, ResourceReading(
            gpu=ALL_GPUS, mem_used_mib=sum(r.mem_used_mib for r in gpus), mem_total_mib=sum(r.mem_total_mib for r in gpus),
            mem_alloc_mib=sum(r.mem_alloc_mib for r in gpus), util_pct=sum(utils) / len(utils) if utils else None)]
    with transaction.atomic():
        ResourceSample.objects.filter(step=FINE, at=slot, node=node).delete()
        ResourceSample.objects.bulk_create([
            ResourceSample(step=FINE, at=slot, node=node, gpu=r.gpu, mem_used_mib=r.mem_used_mib,
                           mem_total_mib=r.mem_total_mib, mem_alloc_mib=r.mem_alloc_mib, util_pct=r.util_pct)
            for r in readings])
    return slot


# ---------------------------------------------------------------- model counters (web processes)
def _bucket(ms: float) -> int:
    return bisect.bisect_left(LATENCY_BOUNDS_MS, ms)


def _add_hist(into: list[int], other: list[int]) -> list[int]:
    """The bucket-wise sum (a new list; histograms of other lengths are padded)."""
    if len(into) == len(other):
        return [a + b for a, b in zip(into, other, strict=True)]
    n = max(len(into), len(other))
    return [a + b for a, b in zip(into + [0] * (n - len(into)), other + [0] * (n - len(other)), strict=True)]


@dataclass
class ModelSlot:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_hist: list[int] = field(default_factory=list)
    ttft_hist: list[int] = field(default_factory=list)

    def add(self, other: ModelSlot) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.latency_hist = _add_hist(self.latency_hist, other.latency_hist)
        self.ttft_hist = _add_hist(self.ttft_hist, other.ttft_hist)


class ModelCounter:
    """This process's per-model traffic per 10 s slot since the last write (no I/O: the proxy's
    request path calls `add`; serving.proxy.usage's flush takes and writes it)."""

    def __init__(self) -> None:
        self._slots: dict[tuple[int, str], ModelSlot] = {}
        self._lock = threading.Lock()

    def add(self, *, model: str, duration_s: float, ttft_s: float | None, prompt_tokens: int,
            completion_tokens: int, failed: bool, at: float | None = None) -> None:
        key = (int((at if at is not None else time.time()) // FINE * FINE), model[:255])
        with self._lock:
            s = self._slots.get(key)
            if s is None:
                s = self._slots[key] = ModelSlot(latency_hist=[0] * (len(LATENCY_BOUNDS_MS) + 1),
                                                 ttft_hist=[0] * (len(LATENCY_BOUNDS_MS) + 1))
            s.requests += 1
            s.errors += int(failed)
            s.prompt_tokens += prompt_tokens
            s.completion_tokens += completion_tokens
            s.latency_hist[_bucket(duration_s * 1000)] += 1
            if ttft_s is not None:
                s.ttft_hist[_bucket(ttft_s * 1000)] += 1

    def take(self) -> dict[tuple[int, str], ModelSlot]:
        with self._lock:
            slots, self._slots = self._slots, {}
        return slots

    def give_back(self, slots: dict[tuple[int, str], ModelSlot]) -> None:
        with self._lock:
            for key, s in slots.items():
                mine = self._slots.get(key)
                if mine is None:
                    self._slots[key] = s
                else:
                    mine.add(s)


def write_model_slots(slots: dict[tuple[int, str], ModelSlot]) -> None:
    """Add this process's slots to the rows every web process shares (call inside a transaction)."""
    if not slots:
        return
    ats = {at for at, _ in slots}
    existing = {(r.at, r.model): r for r in ModelSample.objects.select_for_update().filter(
        step=FINE, at__in=ats, model__in={m for _, m in slots})}
    new = []
    for (at, model), s in slots.items():
        row = existing.get((at, model))
        if row is None:
            new.append(ModelSample(step=FINE, at=at, model=model, requests=s.requests, errors=s.errors,
                                   prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens,
                                   latency_hist=s.latency_hist, ttft_hist=s.ttft_hist))
            continue
        merged = ModelSlot(row.requests, row.errors, row.prompt_tokens, row.completion_tokens,
                           list(row.latency_hist), list(row.ttft_hist))
        merged.add(s)
        ModelSample.objects.filter(pk=row.pk).update(
            requests=merged.requests, errors=merged.errors, prompt_tokens=merged.prompt_tokens,
            completion_tokens=merged.completion_tokens, latency_hist=merged.latency_hist, ttft_hist=merged.ttft_hist)
    if new:
        ModelSample.objects.bulk_create(new)  # a race with another process: the flush keeps it for the next try


# ---------------------------------------------------------------- downsampling and retention
def _latest(model, step: int) -> int | None:
    row = model.objects.filter(step=step).order_by("-at").values_list("at", flat=True).first()
    return row


def downsample(now: float | None = None) -> dict[str, int]:
    """Roll finished windows of each resolution into the next one, then prune each resolution past
    its retention. Safe to run anywhere and often (what is rolled already is skipped)."""
    now = time.time() if now is None else now
    done = {"rolled": 0, "pruned": 0}
    for fine, coarse in zip(TIERS, TIERS[1:], strict=False):
        end = int(now // coarse * coarse)  # windows ending before now are finished
        with transaction.atomic():
            for model, roll in ((ResourceSample, _roll_resources), (ModelSample, _roll_models)):
                last = _latest(model, coarse)
                oldest = model.objects.filter(step=fine).order_by("at").values_list("at", flat=True).first()
                if oldest is None:
                    continue
                start = max(last + coarse if last is not None else 0, oldest // coarse * coarse)
                if start < end:
                    done["rolled"] += roll(fine, coarse, start, end)
    for step, keep in RETENTION_S.items():
        cutoff = int(now) - keep
        for model in (ResourceSample, ModelSample):
            done["pruned"] += model.objects.filter(step=step, at__lt=cutoff).delete()[0]
    return done


def _roll_resources(fine: int, coarse: int, start: int, end: int) -> int:
    table = ResourceSample._meta.db_table
    with connection.cursor() as cur:
        c = int(coarse)  # a literal, not a parameter: PostgreSQL groups by the same expression only
        cur.execute(
            f"INSERT INTO {table} (step, at, node, gpu, mem_used_mib, mem_total_mib, mem_alloc_mib, util_pct) "
            f"SELECT {c}, (at / {c}) * {c}, node, gpu, CAST(AVG(mem_used_mib) AS INTEGER), MAX(mem_total_mib), "
            f"CAST(AVG(mem_alloc_mib) AS INTEGER), AVG(util_pct) FROM {table} "
            f"WHERE step = %s AND at >= %s AND at < %s GROUP BY (at / {c}) * {c}, node, gpu",
            [fine, start, end])
        return cur.rowcount


def _roll_models(fine: int, coarse: int, start: int, end: int) -> int:
    merged: dict[tuple[int, str], ModelSlot] = {}
    for r in ModelSample.objects.filter(step=fine, at__gte=start, at__lt=end).iterator():
        key = (r.at // coarse * coarse, r.model)
        merged.setdefault(key, ModelSlot()).add(
            ModelSlot(r.requests, r.errors, r.prompt_tokens, r.completion_tokens, r.latency_hist, r.ttft_hist))
    ModelSample.objects.bulk_create([
        ModelSample(step=coarse, at=at, model=model, requests=s.requests, errors=s.errors,
                    prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens,
                    latency_hist=s.latency_hist, ttft_hist=s.ttft_hist) for (at, model), s in merged.items()])
    return len(merged)


# ---------------------------------------------------------------- reading
def _windows(model, rng: Range, now: float) -> tuple[int, int, list[tuple[int, int, int]]]:
    """(first slot, slot count, [(step, from, to)]): the coarse rows first, finer rows after them."""
    end = int(now // rng.bucket_s * rng.bucket_s) + rng.bucket_s
    start = end - rng.seconds
    tiers = [t for t in TIERS if t <= rng.tier]
    windows, lo = [], start
    for step in reversed(tiers):
        finer = [t for t in tiers if t < step]
        if finer:
            last = _latest(model, step)
            hi = max(lo, min(end, last + step)) if last is not None else lo
        else:
            hi = end
        if hi > lo:
            windows.append((step, lo, hi))
        lo = hi
    return start, rng.seconds // rng.bucket_s, windows


@dataclass
class ResourceSeries:
    """One node's (gpu -1) or GPU's values per chart slot (None where no sample)."""

    node: str
    gpu: int
    mem_used_mib: list[float | None]
    mem_alloc_mib: list[float | None]
    util_pct: list[float | None]
    mem_total_mib: int = 0


def resource_series(rng: Range, *, node: str | None = None, per_gpu: bool = False, now: float | None = None
                    ) -> tuple[list[int], dict[tuple[str, int], ResourceSeries]]:
    """Slot start times and series over `rng` (one query), of every node or of one: the host and
    all-GPUs rows (the dashboard's view), or with `per_gpu` the host and each GPU's rows."""
    now = time.time() if now is None else now
    start, count, windows = _windows(ResourceSample, rng, now)
    times = [start + i * rng.bucket_s for i in range(count)]
    out: dict[tuple[str, int], ResourceSeries] = {}
    if not windows:
        return times, out
    table, b = ResourceSample._meta.db_table, int(rng.bucket_s)
    where = " OR ".join("(step = %s AND at >= %s AND at < %s)" for _ in windows)
    params: list = []
    for w in windows:
        params.extend(w)
    node_sql = " AND gpu <> %s" if per_gpu else " AND gpu < 0"
    if per_gpu:
        params.append(ALL_GPUS)
    if node is not None:
        node_sql += " AND node = %s"
        params.append(node)
    sql = (f"SELECT node, gpu, (at / {b}) * {b}, SUM(mem_used_mib * step) * 1.0 / SUM(step), "
           f"SUM(mem_alloc_mib * step) * 1.0 / SUM(step), "
           f"SUM(util_pct * step) / NULLIF(SUM(CASE WHEN util_pct IS NULL THEN 0 ELSE step END), 0), "
           f"MAX(mem_total_mib) FROM {table} WHERE ({where}){node_sql} GROUP BY node, gpu, (at / {b}) * {b}")
    with connection.cursor() as cur:
        cur.execute(sql, params)
        rows = cur.fetchall()
    for n, gpu, slot, used, alloc, util, total in rows:
        i = (slot - start) // b
        if not 0 <= i < count:
            continue
        s = out.get((n, gpu))
        if s is None:
            s = out[(n, gpu)] = ResourceSeries(n, gpu, [None] * count, [None] * count, [None] * count)
        # PostgreSQL answers these averages as numeric (Decimal): floats for the charts.
        s.mem_used_mib[i], s.mem_alloc_mib[i], s.util_pct[i] = _float(used), _float(alloc), _float(util)
        s.mem_total_mib = max(s.mem_total_mib, int(total or 0))
    return times, out


def _float(value) -> float | None:
    return None if value is None else float(value)


def percentile(hist: list[int], q: float) -> float | None:
    """The q-quantile (ms) of a latency histogram, linear inside its bucket; None when empty."""
    n = sum(hist)
    if n == 0:
        return None
    rank, seen = q * n, 0
    for i, c in enumerate(hist):
        if c and seen + c >= rank:
            lo = LATENCY_BOUNDS_MS[i - 1] if i > 0 else 0
            hi = LATENCY_BOUNDS_MS[i] if i < len(LATENCY_BOUNDS_MS) else LATENCY_BOUNDS_MS[-1] * 2
            return lo + (hi - lo) * (rank - seen) / c
        seen += c
    return float(LATENCY_BOUNDS_MS[-1])


@dataclass
class ModelSeries:
    model: str
    slots: list[ModelSlot | None]


def model_series(rng: Range, *, now: float | None = None) -> tuple[list[int], dict[str, ModelSeries]]:
    """Slot start times and each model's traffic per slot over `rng`."""
    now = time.time() if now is None else now
    start, count, windows = _windows(ModelSample, rng, now)
    times = [start + i * rng.bucket_s for i in range(count)]
    out: dict[str, ModelSeries] = {}
    if not windows:
        return times, out
    table = ModelSample._meta.db_table
    where = " OR ".join("(step = %s AND at >= %s AND at < %s)" for _ in windows)
    params = [v for w in windows for v in w]
    with connection.cursor() as cur:  # raw: Django's JSON field decoding is most of the time otherwise
        cur.execute(f"SELECT model, at, requests, errors, prompt_tokens, completion_tokens, latency_hist, ttft_hist "
                    f"FROM {table} WHERE {where}", params)
        rows = cur.fetchall()
    loads = json.loads
    for model, at, req, err, pt, ct, lh, th in rows:
        i = (at - start) // rng.bucket_s
        if not 0 <= i < count:
            continue
        s = out.get(model)
        if s is None:
            s = out[model] = ModelSeries(model, [None] * count)
        lh = loads(lh) if isinstance(lh, str) else lh or []
        th = loads(th) if isinstance(th, str) else th or []
        slot = s.slots[i]
        if slot is None:
            s.slots[i] = ModelSlot(req, err, pt, ct, lh, th)
            continue
        slot.requests += req
        slot.errors += err
        slot.prompt_tokens += pt
        slot.completion_tokens += ct
        slot.latency_hist = _add_hist(slot.latency_hist, lh)
        slot.ttft_hist = _add_hist(slot.ttft_hist, th)
    return times, out


__all__ = ["ALL_GPUS", "HOST_GPU", "RANGES", "DEFAULT_RANGE", "Range", "ResourceReading", "record_resources", "ModelCounter",
           "write_model_slots", "downsample", "resource_series", "model_series", "percentile", "dashboard_group"]
