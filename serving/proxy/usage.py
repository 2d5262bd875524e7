"""Usage that lasts: per-hour usage buckets and the request log, counted by the proxy in memory and
written by every web process in batches (every XGEN_USAGE_FLUSH seconds and at shutdown), never
on a request's path. A graceful stop loses nothing; a crash (kill -9) loses nothing either: until
it is written each request is also a line in the process's usage journal (serving.proxy.usage_journal),
which the next process on the same data dir (or a node agent there) replays, once.

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
import json
import logging
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings

from history.samples import ModelCounter, ModelSlot, write_model_slots
from live.db import db_async, run_db
from live.tasks import cancel_and_wait
from serving.proxy.usage_journal import UsageJournal, orphan_segments, stale

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
              "client_request_id", "usage_source", "team_id", "team_slug", "resumes")
# A journal record written before the rows named their team (0.3 before the team fields) is 3 shorter,
# one written before they counted resumed streams 1 shorter.
ROW_FIELDS_BEFORE_TEAMS = len(ROW_FIELDS) - 3
ROW_FIELDS_BEFORE_RESUMES = len(ROW_FIELDS) - 1
GROUPS = {"key": ("key_id", "key_name"), "user": ("username",), "model": ("model",), "node": ("node",),
          "instance": ("instance_id", "model", "node"), "team": ("team_id", "team_slug")}


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
    failed_on: tuple[int, str] | None = None  # (instance id, node) of the replica that failed the request
    route_key: bytes | None = None  # the start of the prompt the replica is chosen by (serving.proxy.prefix)
    resumes: int = 0  # times its stream went on on another replica (serving.proxy.resume)

    @property
    def answer_request_id(self) -> str:
        """The X-Request-ID the client is answered with: its own when it sent one, else the console's."""
        return self.client_request_id or self.request_id


@dataclass
class _Counts:
    key_name: str = ""
    team_slug: str = ""
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    busy_seconds: float = 0.0

    def add(self, other: _Counts) -> None:
        self.key_name = other.key_name or self.key_name
        self.team_slug = other.team_slug or self.team_slug
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


BucketKey = tuple[int, int, str, str, int, str, int]  # hour, key_id, username, model, instance_id, node, team_id
_UNSET = object()  # the process recorder's journal before its first record
_dumps = json.JSONEncoder(separators=(",", ":")).encode


def _count(buckets: dict[BucketKey, _Counts], row: tuple, hour: int, bucket_instance_id: int, failed: bool,
           busy_s: float) -> None:
    """Add one request (its request-log row) to its hour's bucket."""
    bucket = (hour, row[2], row[4], row[5], bucket_instance_id, row[7], row[18])
    counts = buckets.get(bucket)
    if counts is None:
        counts = buckets[bucket] = _Counts()
    counts.key_name = row[3]
    counts.team_slug = row[19]
    counts.requests += 1
    counts.errors += int(failed)
    counts.prompt_tokens += row[12]
    counts.completion_tokens += row[13]
    counts.busy_seconds += busy_s


def _journal_line(row: tuple, hour: int, bucket_instance_id: int, failed: bool, busy_s: float) -> bytes:
    """One journal record: the request-log row (ROW_FIELDS), then what its bucket needs besides."""
    return (_dumps([*row, hour, bucket_instance_id, failed, busy_s]) + "\n").encode()


class UsageRecorder:
    """This process's usage since the last write, and the loop that writes it."""

    def __init__(self, *, journal: UsageJournal | None = None, journal_from_settings: bool = False) -> None:
        """`journal`: where every recorded request is also appended until written (a crash then loses
        none); `journal_from_settings`: the one the settings ask for, opened at the first record
        (the process's recorder)."""
        self._journal: UsageJournal | None | object = journal if journal is not None else (
            _UNSET if journal_from_settings else None)
        self._journal_from_settings = journal_from_settings
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
        ended = time.perf_counter() if ended is None else ended
        self.models.add(model=model, duration_s=ended - ctx.t0, ttft_s=ttft_s,
                        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, failed=failed, at=now)
        row = self._row(ctx, model=model, instance_id=instance_id, node=node, status=status, error=error or "",
                        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, ttft_s=ttft_s,
                        ended=ended, usage_source=usage_source)
        self._add(row, hour_of(now), instance_id, failed=failed, busy_s=busy_s)

    def record_refused(self, ctx: RequestContext, *, status: int, code: str | None) -> None:
        """A request the proxy answered itself after knowing who sent it (429, 403, 404, 502, 503...):
        in the request log, and in the key's usage as a request (an error unless the client left)."""
        if ctx.logged:
            return
        instance_id, node = ctx.failed_on or (None, "")
        row = self._row(ctx, model=ctx.model, instance_id=instance_id, node=node, status=status, error=code or "",
                        prompt_tokens=0, completion_tokens=0, ttft_s=None)
        self._add(row, hour_of(time.time()), 0, failed=status >= 400 and status != 499, busy_s=0.0)

    @staticmethod
    def _row(ctx: RequestContext, *, model: str, instance_id: int | None, node: str, status: int, error: str,
             prompt_tokens: int, completion_tokens: int, ttft_s: float | None, ended: float | None = None,
             usage_source: str = "engine") -> tuple:
        ctx.logged = True
        p = ctx.principal
        return (  # ROW_FIELDS
            ctx.at, ctx.request_id, p.key_id if p else 0, p.key_name if p else "", p.username if p else "",
            model[:255], instance_id, node, status, error[:64],
            round(ttft_s * 1000, 2) if ttft_s is not None else None,
            round(((time.perf_counter() if ended is None else ended) - ctx.t0) * 1000, 2), prompt_tokens,
            completion_tokens, ctx.stream, ctx.client[:64], ctx.client_request_id, usage_source,
            (p.team_id or 0) if p else 0, p.team_slug if p else "", ctx.resumes,
        )

    def _add(self, row: tuple, hour: int, bucket_instance_id: int, *, failed: bool, busy_s: float) -> None:
        """One request: its row in the request log, its counts in its hour's bucket (the bucket's
        key and names come from the row), and its line in the journal, together under the lock
        that _take() holds (so a write's rows are exactly its segments' lines)."""
        journal = self._journal if isinstance(self._journal, UsageJournal) else (
            self._start_journal() if self._journal is _UNSET else None)
        line = _journal_line(row, hour, bucket_instance_id, failed, busy_s) if journal is not None else b""
        with self._lock:
            _count(self._buckets, row, hour, bucket_instance_id, failed, busy_s)
            self._rows.append(row)
            if len(self._rows) > REQUEST_ROWS_MAX:
                drop = len(self._rows) - REQUEST_ROWS_MAX
                del self._rows[:drop]
                self.dropped_rows += drop
            if journal is not None:
                journal.append(line)

    def _start_journal(self) -> UsageJournal | None:
        """The process's journal, as the settings ask (the first record opens it)."""
        with self._lock:
            if self._journal is _UNSET:
                self._journal = (UsageJournal(settings.USAGE_JOURNAL_DIR, fsync=settings.USAGE_JOURNAL_FSYNC)
                                 if self._journal_from_settings and settings.USAGE_JOURNAL else None)
            return self._journal if isinstance(self._journal, UsageJournal) else None

    def pending_tokens(self, key_id: int, since: float) -> int:
        """Tokens of a key (or a team: key id -team id, what its keys used while it owned them)
        counted here since `since` (epoch) and not written yet."""
        column, wanted = (6, -key_id) if key_id < 0 else (1, key_id)
        with self._lock:
            return sum(c.prompt_tokens + c.completion_tokens for b, c in self._buckets.items()
                       if b[column] == wanted and b[0] >= hour_of(since))

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
            await self.replay_orphans()  # at the start: what a killed process on this data dir left
            await asyncio.sleep(settings.USAGE_FLUSH_S)
            await self.flush()

    async def replay_orphans(self) -> int:
        """Write what dead processes left in this process's journal directory (rows written)."""
        if not (self._journal_from_settings and settings.USAGE_JOURNAL):
            return 0
        try:
            return await run_db(replay_journal, settings.USAGE_JOURNAL_DIR)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the segments stay for the next try
            log.warning("replaying the usage journal failed (next try in %d s): %s", settings.USAGE_FLUSH_S, exc)
            return 0

    def _take(self) -> tuple[dict[BucketKey, _Counts], list[tuple], dict[tuple[int, str], ModelSlot], list[str]]:
        """What was counted since the last write, and the journal segments that hold it."""
        with self._lock:
            buckets, rows = self._buckets, self._rows
            self._buckets, self._rows = {}, []
            journal = self._journal
            segments = journal.rotate() if isinstance(journal, UsageJournal) else []
        return buckets, rows, self.models.take(), segments

    def _committed(self, segments: list[str]) -> None:
        if segments:
            with self._lock:
                journal = self._journal
                if isinstance(journal, UsageJournal):
                    journal.committed(segments)

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
            buckets, rows, slots, segments = self._take()
            if not buckets and not rows and not slots and not segments:
                return 0
            write = asyncio.ensure_future(_awrite(buckets, rows, slots, segments))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                # Cancelled (a shutdown's stop()): the write goes on in its thread and may commit.
                # Its rows are given back only if it did not: giving them back at once wrote them
                # twice (two identical request-log rows, 2 of the 1,657 tests of a CI run).
                await asyncio.wait({write})
                if write.cancelled() or write.exception() is not None:
                    self._give_back(buckets, rows, slots)
                else:
                    self._committed(segments)
                raise
            except Exception as exc:
                self._give_back(buckets, rows, slots)
                log.warning("writing usage failed (%d buckets, %d request rows kept for the next try): %s",
                            len(buckets), len(rows), exc)
                return 0
            self._committed(segments)
        if slots:
            for hook in self.after_write:
                try:
                    await hook()
                except Exception:  # a live push must never lose usage
                    log.warning("after-write hook failed", exc_info=True)
        return len(buckets) + len(rows)

    def flush_sync(self) -> int:
        """flush() for code with no event loop (tests, the Ninja path under a sync server)."""
        buckets, rows, slots, segments = self._take()
        if not buckets and not rows and not slots and not segments:
            return 0
        try:
            _write(buckets, rows, slots, segments)
        except Exception:
            self._give_back(buckets, rows, slots)
            raise
        self._committed(segments)
        return len(buckets) + len(rows)

    async def stop(self) -> None:
        """Stop the loop and write the rest (process shutdown); a journal all written goes."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        await self.flush()
        with self._lock:
            if isinstance(self._journal, UsageJournal):
                self._journal.finish()


def _write(buckets: dict[BucketKey, _Counts], rows: list[tuple],
           slots: dict[tuple[int, str], ModelSlot] | None = None, segments: list[str] | None = None) -> None:
    """Add the counts to their hour's rows (created when missing; another process may race),
    append the request-log rows, add the models' 10 s slots and record the journal segments that
    held them as committed, in one transaction."""
    from django.db import transaction

    with transaction.atomic():
        _write_in_transaction(buckets, rows, slots, segments)


def _write_in_transaction(buckets: dict[BucketKey, _Counts], rows: list[tuple],
                          slots: dict[tuple[int, str], ModelSlot] | None, segments: list[str] | None) -> None:
    from django.db import IntegrityError, transaction
    from django.db.models import F

    from serving.models import RequestLog, UsageBucket, UsageJournalSegment

    if segments:  # the journal's segments that held these rows: a replay never writes them again
        # (ignore_conflicts: a write whose commit was lost with its connection but happened is tried
        # again with the same names, as it was before the journal; it must not stick on them)
        UsageJournalSegment.objects.bulk_create([UsageJournalSegment(name=name) for name in segments],
                                                ignore_conflicts=True)
    for (hour, key_id, username, model, instance_id, node, team_id), c in buckets.items():
        where = {"bucket_start": datetime.fromtimestamp(hour, tz=UTC), "key_id": key_id, "username": username,
                 "model": model, "instance_id": instance_id, "node": node, "team_id": team_id}
        increments = {
            "requests": F("requests") + c.requests, "errors": F("errors") + c.errors,
            "prompt_tokens": F("prompt_tokens") + c.prompt_tokens,
            "completion_tokens": F("completion_tokens") + c.completion_tokens,
            "busy_seconds": F("busy_seconds") + c.busy_seconds, "key_name": c.key_name,
            "team_slug": c.team_slug,
        }
        if UsageBucket.objects.filter(**where).update(**increments):
            continue
        try:
            with transaction.atomic():
                UsageBucket.objects.create(
                    **where, key_name=c.key_name, team_slug=c.team_slug, requests=c.requests, errors=c.errors,
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


def replay_journal(directory: Path) -> int:
    """Write the journal segments in `directory` that dead processes left (their lock is free):
    each one's rows and counts with its name as committed, in one transaction, unless its name was
    committed already (its owner died between its commit and the delete); then delete it. The
    number of rows written. A segment that cannot be written stays for the next try."""
    written = 0
    failed: list[str] = []
    first_error: Exception | None = None
    max_age_s = settings.REQUEST_LOG_DAYS * 86400
    for segment in orphan_segments(directory):
        if stale(segment, max_age_s):  # its committed name may be pruned: it could count twice
            log.warning("usage journal: %s is older than XGEN_REQUEST_LOG_DAYS (%d rows): deleted, not replayed",
                        segment.name, len(segment.records))
            segment.done()
            continue
        try:
            rows = _replay_segment(segment.name, segment.records)
        except Exception as exc:  # kept for the next try; the other segments go on
            failed.append(segment.name)
            first_error = first_error or exc
            continue
        segment.done()
        if rows:
            log.info("usage journal: %d request rows of %s (a process that stopped without writing them) "
                     "replayed", rows, segment.name)
        written += rows
    if failed:
        log.warning("usage journal: %d segments could not be replayed (kept for the next try; first: %s): %s",
                    len(failed), failed[0], first_error)
    return written


def _replay_segment(name: str, records: list[list]) -> int:
    """One dead process's segment into the database (unless its name is committed): rows written."""
    from django.db import transaction

    from serving.models import UsageJournalSegment

    buckets: dict[BucketKey, _Counts] = {}
    rows: list[tuple] = []
    for record in records:
        if len(record) == ROW_FIELDS_BEFORE_TEAMS + 4:  # written by a version before the team fields
            record = [*record[:ROW_FIELDS_BEFORE_TEAMS], *_team_of_key(record[2]), 0, *record[ROW_FIELDS_BEFORE_TEAMS:]]
        elif len(record) == ROW_FIELDS_BEFORE_RESUMES + 4:  # written by a version before resumed streams
            record = [*record[:ROW_FIELDS_BEFORE_RESUMES], 0, *record[ROW_FIELDS_BEFORE_RESUMES:]]
        if len(record) != len(ROW_FIELDS) + 4:
            log.warning("usage journal %s: a record of %d fields, not %d: skipped", name, len(record),
                        len(ROW_FIELDS) + 4)
            continue
        row = tuple(record[:len(ROW_FIELDS)])
        hour, bucket_instance_id, failed, busy_s = record[len(ROW_FIELDS):]
        _count(buckets, row, hour, bucket_instance_id, failed, busy_s)
        rows.append(row)
    with transaction.atomic():
        if UsageJournalSegment.objects.filter(name=name).exists():
            return 0
        if rows:
            _write_in_transaction(buckets, rows, None, [name])
    return len(rows)


def _team_of_key(key_id: int) -> tuple[int, str]:
    """(team id, slug) of the team that owns a key now, (0, "") for none: what a journal record of
    the version before the team fields is charged to (the team it would have been read under)."""
    from accounts.models import ApiKey

    found = ApiKey.objects.filter(pk=key_id, team__isnull=False).values_list("team_id", "team__slug").first() \
        if key_id else None
    return (found[0], found[1]) if found else (0, "")


def prune_journal_segments(*, days: int | None = None) -> int:
    """Forget committed journal segments older than the request log keeps its rows (a segment file
    that old is never replayed)."""
    from serving.models import UsageJournalSegment

    cutoff = datetime.now(tz=UTC) - timedelta(days=(days or settings.REQUEST_LOG_DAYS) + 1)
    return UsageJournalSegment.objects.filter(committed_at__lt=cutoff).delete()[0]


_awrite = db_async(_write, retry=False)  # a write must not run twice: a lost connection keeps it for the next try

recorder = UsageRecorder(journal_from_settings=True)


# ---------------------------------------------------------------- reads
def whole_buckets(start: datetime, end: datetime, *, day: bool = False) -> tuple[datetime, datetime]:
    """[start, end) widened to whole hours (days): usage is kept per hour."""
    step = 86400 if day else 3600
    s, e = start.timestamp() // step * step, -(-end.timestamp() // step) * step
    return datetime.fromtimestamp(s, tz=UTC), datetime.fromtimestamp(e, tz=UTC)


def tokens_used(key_id: int, since: datetime) -> int:
    """Prompt + completion tokens of a key (or a team: key id -team id, what its keys used while
    the team owned them) written since `since` (an hour boundary)."""
    from django.db.models import Sum

    from serving.models import UsageBucket

    where = {"team_id": -key_id} if key_id < 0 else {"key_id": key_id}
    totals = UsageBucket.objects.filter(**where, bucket_start__gte=since).aggregate(
        p=Sum("prompt_tokens"), c=Sum("completion_tokens"))
    return int(totals["p"] or 0) + int(totals["c"] or 0)


USAGE_SUMS = ("requests", "errors", "prompt_tokens", "completion_tokens", "busy_seconds")


def usage_rows(*, start: datetime, end: datetime, group_by: str, bucket: str, key_id: int | None = None,
               model: str | None = None, models: frozenset[str] | None = None,
               team_ids: Collection[int] | None = None) -> list[dict]:
    """Usage summed per `bucket` (hour | day) and `group_by` (key | user | model | node | instance |
    team: the team that owned the key when it was used; None: no team) over [start, end), oldest
    first; `models`: only theirs (a key's allowed_models); `team_ids`: only what these teams' keys
    used while the teams owned them."""
    from django.db.models import F, Sum
    from django.db.models.functions import TruncDay

    from serving.models import UsageBucket

    fields = GROUPS[group_by]
    start, end = whole_buckets(start, end, day=bucket == "day")
    qs = UsageBucket.objects.filter(bucket_start__gte=start, bucket_start__lt=end)
    if key_id is not None:
        qs = qs.filter(key_id=key_id)
    if team_ids is not None:
        qs = qs.filter(team_id__in=sorted(team_ids))
    if model:
        qs = qs.filter(model=model)
    if models is not None:
        qs = qs.filter(model__in=sorted(models))
    qs = qs.annotate(b=TruncDay("bucket_start", tzinfo=UTC) if bucket == "day" else F("bucket_start"))
    group = [f for f in fields if f not in ("key_name", "team_slug")]
    rows = (qs.values("b", *group)
            .annotate(requests=Sum("requests"), errors=Sum("errors"), prompt_tokens=Sum("prompt_tokens"),
                      completion_tokens=Sum("completion_tokens"), busy_seconds=Sum("busy_seconds"))
            .order_by("b", *group))
    names = _key_names(qs) if group_by == "key" else (_team_names(qs) if group_by == "team" else {})
    out = []
    for r in rows:
        item = {"bucket_start": r["b"], **{f: r[f] for f in group}}
        if group_by == "key":
            item["key_name"] = names.get(r["key_id"], "")
        if group_by == "team":
            item["team"] = names.get(r["team_id"]) or None
            item["team_id"] = r["team_id"] or None
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


def _team_names(qs) -> dict[int, str]:
    """team_id -> its slug in the rows (a deleted team's stays)."""
    return dict(qs.exclude(team_id=0).order_by("bucket_start").values_list("team_id", "team_slug"))


def request_rows(*, key: str | None = None, model: str | None = None, status: int | None = None,
                 request_id: str | None = None, before: int | None = None, limit: int = 100,
                 models: frozenset[str] | None = None, team_ids: Collection[int] | None = None) -> list[dict]:
    """The request log, newest first; `key` is a key id or a key name; `request_id` the console's
    id of a request or the caller's own (X-Request-ID); `team_ids`: only the rows of these teams'
    keys while the teams owned them. Each row names the team that owned its key then."""
    from serving.models import RequestLog

    qs = RequestLog.objects.all()
    if team_ids is not None:
        qs = qs.filter(team_id__in=sorted(team_ids))
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
    page = list(qs.order_by("-pk")[:limit])
    return [
        {"id": r.pk, "time": r.at, "request_id": r.request_id, "key_id": r.key_id or None, "key_name": r.key_name,
         "team": r.team_slug or None,
         "user": r.username, "model": r.model, "instance_id": r.instance_id, "node": r.node, "status": r.status,
         "error": r.error or None, "ttft_ms": r.ttft_ms, "duration_ms": r.duration_ms,
         "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens, "stream": r.stream,
         "client": r.client, "client_request_id": r.client_request_id, "usage_source": r.usage_source,
         "resumes": r.resumes}
        for r in page
    ]
