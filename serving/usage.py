"""Usage that lasts: per-hour usage buckets and the request log, counted by the proxy in memory and
written by every web process in batches (every XGEN_USAGE_FLUSH seconds and at shutdown), never
on a request's path. A graceful stop loses nothing; a crash at most the last interval.

Busy seconds: while an instance has n requests open in this process, each of them accrues 1/n of
every second, so the busy seconds of the keys that used an instance add up to the time it was
busy at all (the basis of chargeback's GPU-seconds, serving/chargeback.py).

The same flush writes each model's 10 s slots for the dashboard (history.ModelSample): requests,
errors, tokens and latency/TTFT histograms, summed over every web process.

Also here: the reads behind `GET /api/usage` and `GET /api/requests`, the token totals quotas
start from, and the agent's worker that prunes the request log.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from django.conf import settings

from history.samples import ModelCounter, ModelSlot, write_model_slots
from live.db import db_async, run_db
from live.tasks import cancel_and_wait
from serving.node.worker import AgentWorker

if TYPE_CHECKING:
    from accounts.credentials import Principal

log = logging.getLogger("xgen.usage")

REQUEST_ROWS_MAX = 50_000  # rows held while the database is down; the oldest go first past this
# A request-log row as the proxy keeps it until the next write: a tuple of plain values in this
# order (the RequestLog fields but its primary key). The garbage collector stops tracking such a
# tuple at its first collection, where a dict row stayed tracked for up to a write's interval
# (5 s of requests). This alone did not end the full collections at c=64 (12 in 16 s instead of
# 13): the frozen start-up heap did (xgenconsole/asgi.py).
ROW_FIELDS = ("at", "request_id", "key_id", "key_name", "username", "model", "instance_id", "node", "status",
              "error", "ttft_ms", "duration_ms", "prompt_tokens", "completion_tokens", "stream", "client",
              "client_request_id", "usage_source")
GROUPS = {"key": ("key_id", "key_name"), "user": ("username",), "model": ("model",), "node": ("node",),
          "instance": ("instance_id", "model", "node")}


@dataclass(eq=False)
class RequestContext:
    """One proxied request as the proxy learns about it: who, what, from where, and how it went."""

    request_id: str
    client: str = ""
    principal: Principal | None = None
    model: str = ""
    stream: bool = False
    drop_usage_chunk: bool = False  # the proxy asked the backend for stream usage the client did not ask for
    usage_asked: bool = False  # the client's stream asked for usage (stream_options.include_usage)
    rate_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    extra_headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # X-XGEN-Cold-Start
    comments_sent: bool = False  # a stream's headers went out with `: loading` comments during a cold start
    client_request_id: str = ""  # the caller's X-Request-ID (request_id is the console's, the backend's)
    t0: float = field(default_factory=time.perf_counter)
    at: float = field(default_factory=time.time)
    logged: bool = False

    @property
    def answer_request_id(self) -> str:
        """The X-Request-ID the client is answered with: its own when it sent one, else the console's."""
        return self.client_request_id or self.request_id


@dataclass
class _Counts:
    key_name: str = ""
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    busy_seconds: float = 0.0

    def add(self, other: _Counts) -> None:
        self.key_name = other.key_name or self.key_name
        self.requests += other.requests
        self.errors += other.errors
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.busy_seconds += other.busy_seconds


class BusyClock:
    """One instance's busy time in this process, shared fairly among its open requests.

    `virtual` advances by dt/n while n requests are open; a request's busy seconds are the
    virtual time between its start and its stop, so concurrent requests split the time.
    """

    __slots__ = ("virtual", "last", "open")

    def __init__(self) -> None:
        self.virtual = 0.0
        self.last = 0.0
        self.open = 0

    def _advance(self, now: float) -> None:
        if self.open > 0 and now > self.last:
            self.virtual += (now - self.last) / self.open
        self.last = max(self.last, now)

    def start(self, now: float) -> float:
        self._advance(now)
        self.open += 1
        return self.virtual

    def stop(self, now: float, mark: float) -> float:
        self._advance(now)
        self.open = max(0, self.open - 1)
        return self.virtual - mark


def hour_of(epoch: float) -> int:
    return int(epoch // 3600 * 3600)


BucketKey = tuple[int, int, str, str, int, str]  # hour, key_id, username, model, instance_id, node


class UsageRecorder:
    """This process's usage since the last write, and the loop that writes it."""

    def __init__(self) -> None:
        self._buckets: dict[BucketKey, _Counts] = {}
        self._rows: list[tuple] = []  # ROW_FIELDS
        self._clocks: dict[int, BusyClock] = {}
        self._lock = threading.Lock()
        self._task: asyncio.Task | None = None
        self._flushing: asyncio.Lock | None = None
        self.dropped_rows = 0
        self.models = ModelCounter()
        self.after_write: list = []  # async callables run after a flush that wrote model slots (live dashboard)

    # ------------------------------------------------------------ on the request path (no I/O)
    def busy_start(self, instance_id: int) -> float:
        clock = self._clocks.get(instance_id)
        if clock is None:
            clock = self._clocks[instance_id] = BusyClock()
        return clock.start(time.perf_counter())

    def busy_stop(self, instance_id: int, mark: float) -> float:
        clock = self._clocks.get(instance_id)
        return clock.stop(time.perf_counter(), mark) if clock is not None else 0.0

    def record(self, ctx: RequestContext, *, model: str, instance_id: int, node: str, status: int,
               error: str | None, prompt_tokens: int, completion_tokens: int, busy_s: float,
               ttft_s: float | None, failed: bool, ended: float | None = None,
               usage_source: str = "engine") -> None:
        """Count one request a backend answered (or broke off), in its hour and the request log.
        `ended` (perf_counter) when it is recorded later than it ended (once the engine counted its
        prompt); `usage_source` says who counted its tokens (`engine`, or `console`)."""
        now = time.time()
        self._count(ctx, now, model, instance_id, node, failed=failed, prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens, busy_s=busy_s)
        ended = time.perf_counter() if ended is None else ended
        self.models.add(model=model, duration_s=ended - ctx.t0, ttft_s=ttft_s,
                        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, failed=failed, at=now)
        self._log(ctx, model=model, instance_id=instance_id, node=node, status=status, error=error or "",
                  prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, ttft_s=ttft_s, ended=ended,
                  usage_source=usage_source)

    def record_refused(self, ctx: RequestContext, *, status: int, code: str | None) -> None:
        """A request the proxy answered itself after knowing who sent it (429, 403, 404, 502, 503...):
        in the request log, and in the key's usage as a request (an error unless the client left)."""
        if ctx.logged:
            return
        self._count(ctx, time.time(), ctx.model[:255], 0, "", failed=status >= 400 and status != 499)
        self._log(ctx, model=ctx.model, instance_id=None, node="", status=status, error=code or "",
                  prompt_tokens=0, completion_tokens=0, ttft_s=None)

    def _count(self, ctx: RequestContext, now: float, model: str, instance_id: int, node: str, *, failed: bool,
               prompt_tokens: int = 0, completion_tokens: int = 0, busy_s: float = 0.0) -> None:
        """Add one request to its hour's bucket."""
        p = ctx.principal
        key_id, key_name, username = (p.key_id, p.key_name, p.username) if p is not None else (0, "", "")
        bucket = (hour_of(now), key_id, username, model, instance_id, node)
        with self._lock:
            counts = self._buckets.get(bucket)
            if counts is None:
                counts = self._buckets[bucket] = _Counts()
            counts.key_name = key_name
            counts.requests += 1
            counts.errors += int(failed)
            counts.prompt_tokens += prompt_tokens
            counts.completion_tokens += completion_tokens
            counts.busy_seconds += busy_s

    def _log(self, ctx: RequestContext, *, model: str, instance_id: int | None, node: str, status: int, error: str,
             prompt_tokens: int, completion_tokens: int, ttft_s: float | None, ended: float | None = None,
             usage_source: str = "engine") -> None:
        ctx.logged = True
        p = ctx.principal
        row = (  # ROW_FIELDS
            ctx.at, ctx.request_id, p.key_id if p else 0, p.key_name if p else "", p.username if p else "",
            model[:255], instance_id, node, status, error[:64],
            round(ttft_s * 1000, 2) if ttft_s is not None else None,
            round(((time.perf_counter() if ended is None else ended) - ctx.t0) * 1000, 2), prompt_tokens,
            completion_tokens, ctx.stream, ctx.client[:64], ctx.client_request_id, usage_source,
        )
        with self._lock:
            self._rows.append(row)
            if len(self._rows) > REQUEST_ROWS_MAX:
                drop = len(self._rows) - REQUEST_ROWS_MAX
                del self._rows[:drop]
                self.dropped_rows += drop

    def pending_tokens(self, key_id: int, since: float) -> int:
        """Tokens of `key_id` counted here since `since` (epoch) and not written yet."""
        with self._lock:
            return sum(c.prompt_tokens + c.completion_tokens for b, c in self._buckets.items()
                       if b[1] == key_id and b[0] >= hour_of(since))

    # ------------------------------------------------------------ writing, off the request path
    def ensure_started(self) -> None:
        """Start the write loop in the running event loop (once per loop)."""
        task = self._task
        loop = asyncio.get_running_loop()
        if task is None or task.done() or task.get_loop() is not loop:
            self._flushing = asyncio.Lock()
            self._task = loop.create_task(self._run(), name="usage-writer")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(settings.USAGE_FLUSH_S)
            await self.flush()

    def _take(self) -> tuple[dict[BucketKey, _Counts], list[tuple], dict[tuple[int, str], ModelSlot]]:
        with self._lock:
            buckets, rows = self._buckets, self._rows
            self._buckets, self._rows = {}, []
        return buckets, rows, self.models.take()

    def _give_back(self, buckets: dict[BucketKey, _Counts], rows: list[tuple],
                   slots: dict[tuple[int, str], ModelSlot]) -> None:
        self.models.give_back(slots)
        with self._lock:
            for bucket, counts in buckets.items():
                mine = self._buckets.get(bucket)
                if mine is None:
                    self._buckets[bucket] = counts
                else:
                    mine.add(counts)
            self._rows[:0] = rows

    async def flush(self) -> int:
        """Write what was counted since the last write; kept for the next try if that fails.
        The number of buckets and rows written."""
        lock = self._flushing or asyncio.Lock()
        async with lock:
            buckets, rows, slots = self._take()
            if not buckets and not rows and not slots:
                return 0
            try:
                await _awrite(buckets, rows, slots)
            except asyncio.CancelledError:
                self._give_back(buckets, rows, slots)
                raise
            except Exception as exc:
                self._give_back(buckets, rows, slots)
                log.warning("writing usage failed (%d buckets, %d request rows kept for the next try): %s",
                            len(buckets), len(rows), exc)
                return 0
        if slots:
            for hook in self.after_write:
                try:
                    await hook()
                except Exception:  # a live push must never lose usage
                    log.warning("after-write hook failed", exc_info=True)
        return len(buckets) + len(rows)

    def flush_sync(self) -> int:
        """flush() for code with no event loop (tests, the Ninja path under a sync server)."""
        buckets, rows, slots = self._take()
        if not buckets and not rows and not slots:
            return 0
        try:
            _write(buckets, rows, slots)
        except Exception:
            self._give_back(buckets, rows, slots)
            raise
        return len(buckets) + len(rows)

    async def stop(self) -> None:
        """Stop the loop and write the rest (process shutdown)."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        await self.flush()


def _write(buckets: dict[BucketKey, _Counts], rows: list[tuple],
           slots: dict[tuple[int, str], ModelSlot] | None = None) -> None:
    """Add the counts to their hour's rows (created when missing; another process may race),
    append the request-log rows and add the models' 10 s slots, in one transaction."""
    from django.db import IntegrityError, transaction
    from django.db.models import F

    from serving.models import RequestLog, UsageBucket

    with transaction.atomic():
        for (hour, key_id, username, model, instance_id, node), c in buckets.items():
            where = {"bucket_start": datetime.fromtimestamp(hour, tz=UTC), "key_id": key_id, "username": username,
                     "model": model, "instance_id": instance_id, "node": node}
            increments = {
                "requests": F("requests") + c.requests, "errors": F("errors") + c.errors,
                "prompt_tokens": F("prompt_tokens") + c.prompt_tokens,
                "completion_tokens": F("completion_tokens") + c.completion_tokens,
                "busy_seconds": F("busy_seconds") + c.busy_seconds, "key_name": c.key_name,
            }
            if UsageBucket.objects.filter(**where).update(**increments):
                continue
            try:
                with transaction.atomic():
                    UsageBucket.objects.create(
                        **where, key_name=c.key_name, requests=c.requests, errors=c.errors,
                        prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
                        busy_seconds=c.busy_seconds)
            except IntegrityError:  # another web process created it just now
                UsageBucket.objects.filter(**where).update(**increments)
        write_model_slots(slots or {})
        if rows:
            _insert_request_rows(RequestLog, rows)


def _insert_request_rows(model, rows: list[tuple], *, using: str = "default") -> None:
    """The request-log rows (ROW_FIELDS tuples) in one prepared INSERT (executemany): as the ORM's
    bulk_create writes them, without a model instance per row, CPU that web processes spend
    holding the GIL beside the proxy's loop (a row per request, 1,000+ a second under load)."""
    from django.db import connections

    fields = [model._meta.get_field(name) for name in ROW_FIELDS]
    missing = {f.name for f in model._meta.concrete_fields if not f.primary_key} - set(ROW_FIELDS)
    if missing:
        raise RuntimeError(f"ROW_FIELDS lacks {sorted(missing)} of {model.__name__}")
    connection = connections[using]
    quote = connection.ops.quote_name
    adapt = connection.ops.adapt_datetimefield_value
    params = [(adapt(datetime.fromtimestamp(r[0], tz=UTC)), *r[1:]) for r in rows]
    sql = (f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(quote(f.column) for f in fields)}) "
           f"VALUES ({', '.join(['%s'] * len(fields))})")
    with connection.cursor() as cursor:
        cursor.executemany(sql, params)


_awrite = db_async(_write, retry=False)  # a write must not run twice: a lost connection keeps it for the next try

recorder = UsageRecorder()


# ---------------------------------------------------------------- reads
def whole_buckets(start: datetime, end: datetime, *, day: bool = False) -> tuple[datetime, datetime]:
    """[start, end) widened to whole hours (days): usage is kept per hour."""
    step = 86400 if day else 3600
    s, e = start.timestamp() // step * step, -(-end.timestamp() // step) * step
    return datetime.fromtimestamp(s, tz=UTC), datetime.fromtimestamp(e, tz=UTC)


def tokens_used(key_id: int, since: datetime) -> int:
    """Prompt + completion tokens of a key written since `since` (an hour boundary)."""
    from django.db.models import Sum

    from serving.models import UsageBucket

    totals = UsageBucket.objects.filter(key_id=key_id, bucket_start__gte=since).aggregate(
        p=Sum("prompt_tokens"), c=Sum("completion_tokens"))
    return int(totals["p"] or 0) + int(totals["c"] or 0)


def usage_rows(*, start: datetime, end: datetime, group_by: str, bucket: str, key_id: int | None = None,
               model: str | None = None, models: frozenset[str] | None = None) -> list[dict]:
    """Usage summed per `bucket` (hour | day) and `group_by` (key | user | model | node | instance)
    over [start, end), oldest first; `models`: only theirs (a key's allowed_models)."""
    from django.db.models import F, Sum
    from django.db.models.functions import TruncDay

    from serving.models import UsageBucket

    fields = GROUPS[group_by]
    start, end = whole_buckets(start, end, day=bucket == "day")
    qs = UsageBucket.objects.filter(bucket_start__gte=start, bucket_start__lt=end)
    if key_id is not None:
        qs = qs.filter(key_id=key_id)
    if model:
        qs = qs.filter(model=model)
    if models is not None:
        qs = qs.filter(model__in=sorted(models))
    qs = qs.annotate(b=TruncDay("bucket_start", tzinfo=UTC) if bucket == "day" else F("bucket_start"))
    group = [f for f in fields if f != "key_name"]
    rows = (qs.values("b", *group)
            .annotate(requests=Sum("requests"), errors=Sum("errors"), prompt_tokens=Sum("prompt_tokens"),
                      completion_tokens=Sum("completion_tokens"), busy_seconds=Sum("busy_seconds"))
            .order_by("b", *group))
    names = _key_names(qs) if group_by == "key" else {}
    out = []
    for r in rows:
        item = {"bucket_start": r["b"], **{f: r[f] for f in group}}
        if group_by == "key":
            item["key_name"] = names.get(r["key_id"], "")
        if "username" in item:
            item["user"] = item.pop("username")
        item.update(requests=r["requests"] or 0, errors=r["errors"] or 0, prompt_tokens=r["prompt_tokens"] or 0,
                    completion_tokens=r["completion_tokens"] or 0,
                    busy_seconds=round(r["busy_seconds"] or 0.0, 6))
        out.append(item)
    return out


def _key_names(qs) -> dict[int, str]:
    """key_id -> its latest name in the rows (keys may have been renamed or deleted)."""
    names: dict[int, str] = {}
    for key_id, name in qs.order_by("bucket_start").values_list("key_id", "key_name"):
        if name:
            names[key_id] = name
    return names


def request_rows(*, key: str | None = None, model: str | None = None, status: int | None = None,
                 request_id: str | None = None, before: int | None = None, limit: int = 100,
                 models: frozenset[str] | None = None) -> list[dict]:
    """The request log, newest first; `key` is a key id or a key name; `request_id` the console's
    id of a request or the caller's own (X-Request-ID)."""
    from serving.models import RequestLog

    qs = RequestLog.objects.all()
    if key:
        from accounts.query import ascii_int

        key_id = ascii_int(key)  # not str.isdigit(): '²' passes it and int() refuses it
        qs = qs.filter(key_id=key_id) if key_id is not None else qs.filter(key_name=key)
    if model:
        qs = qs.filter(model=model)
    if models is not None:  # a key's allowed_models: the rows of those models only
        qs = qs.filter(model__in=sorted(models))
    if status is not None:
        qs = qs.filter(status=status)
    if request_id:
        from django.db.models import Q

        qs = qs.filter(Q(request_id=request_id) | Q(client_request_id=request_id))
    if before is not None:
        qs = qs.filter(pk__lt=before)
    return [
        {"id": r.pk, "time": r.at, "request_id": r.request_id, "key_id": r.key_id or None, "key_name": r.key_name,
         "user": r.username, "model": r.model, "instance_id": r.instance_id, "node": r.node, "status": r.status,
         "error": r.error or None, "ttft_ms": r.ttft_ms, "duration_ms": r.duration_ms,
         "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens, "stream": r.stream,
         "client": r.client, "client_request_id": r.client_request_id, "usage_source": r.usage_source}
        for r in qs.order_by("-pk")[:limit]
    ]


# ---------------------------------------------------------------- retention
def prune_request_log(*, days: int | None = None, batch: int = 5000) -> int:
    """Delete request-log rows older than XGEN_REQUEST_LOG_DAYS, in batches; how many."""
    from serving.models import RequestLog

    cutoff = datetime.now(tz=UTC) - timedelta(days=days or settings.REQUEST_LOG_DAYS)
    removed = 0
    while True:
        ids = list(RequestLog.objects.filter(at__lt=cutoff).values_list("pk", flat=True)[:batch])
        if not ids:
            return removed
        removed += RequestLog.objects.filter(pk__in=ids).delete()[0]


class RequestLogPruner(AgentWorker):
    """The node agent's part: prune the request log every PRUNE_EVERY_S (every agent may; the
    deletes are idempotent)."""

    name = "request-log-pruner"
    PRUNE_EVERY_S = 3600.0

    async def run(self, agent) -> None:
        while True:
            try:
                removed = await run_db(prune_request_log)
                if removed:
                    log.info("request log: %d rows older than %d days pruned", removed, settings.REQUEST_LOG_DAYS)
            except Exception as exc:
                log.warning("pruning the request log failed (next try in an hour): %s", exc)
            await asyncio.sleep(self.PRUNE_EVERY_S)
