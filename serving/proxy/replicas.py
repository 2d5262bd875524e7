"""Which backends serve which model: an in-memory table the proxy reads on every request.

No request waits for the database once a process has its first table: the table is re-read in
the background, at once when an instance changes state anywhere (serving.control.events pushes a
`routing.changed` message over the channel layer to every web process) and every REFRESH_S as a
safety net (a lost message, a node whose heartbeat went stale, rows written by hand). Requests
always read the current snapshot. `invalidate()` makes the next request wait for a fresh read
(for code that has just changed the rows itself and must see them).
While the database is down the previous table keeps serving; a process that has none yet
raises DatabaseUnavailable (the proxy answers 503) until the database is back. Nor does the
outage count against the nodes' heartbeats once it is over: no agent could write one, so for
NODE_STALE_AFTER_S after the database returns the staleness clock leaves out the time it was
away (a READY backend stays routed until its agent beats again; an agent that died is dropped
within NODE_STALE_AFTER_S of the database's return, as it would be without the outage).
Replicas keep their in-flight counters across refreshes; the least busy one is chosen.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from live.db import DatabaseUnavailable, run_db
from live.groups import GroupListener
from live.tasks import cancel_and_wait
from serving.proxy.prefix import load_cap, score

log = logging.getLogger("xgen.proxy")

REFRESH_S = 1.0
# A replica that refused a connection is tried last for this long.
DOWN_S = 2.0


@dataclass(eq=False)
class Backend:
    """One READY instance the proxy can send requests to."""

    instance_id: int
    model_name: str
    type: str  # "llm" | "embedding"
    backend: str
    node: str
    base_url: str
    created: int
    aliases: tuple[str, ...] = ()
    in_flight: int = 0
    down_until: float = 0.0
    policy: str = "always"
    max_concurrency: int | None = None
    first_byte_timeout_s: int | None = None  # the instance's own wait for an answer's first byte (None: the setting)
    replica: int = 0
    gpus: tuple[int, ...] = ()
    secret: str = field(default="", repr=False)  # the bearer token the backend requires (its instance's row)
    # LoRA adapters loaded with the model (issue 27): ((name, scale), ...) in the engine's order (its ids)
    adapters: tuple[tuple[str, float], ...] = ()

    @property
    def key(self) -> tuple[int, str]:
        return (self.instance_id, self.base_url)

    @property
    def auth_header(self) -> bytes:
        """The request header line that lets the console through to the backend (b"" without a secret)."""
        return b"authorization: Bearer %s\r\n" % self.secret.encode("latin-1") if self.secret else b""

    def mark_down(self) -> None:
        self.down_until = time.monotonic() + DOWN_S


@dataclass(frozen=True)
class Standby:
    """An on_demand instance that is not READY: the one a request for its name starts."""

    instance_id: int
    model_name: str
    type: str
    backend: str
    node: str
    state: str
    created: int
    aliases: tuple[str, ...] = ()


@dataclass
class RoutingSnapshot:
    """One read of the database: READY backends by name and kind, and every name in use."""

    by_name: dict[str, list[Backend]] = field(default_factory=dict)
    by_type: dict[str, list[Backend]] = field(default_factory=dict)
    known_names: frozenset[str] = frozenset()
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> served name
    adapters: dict[str, str] = field(default_factory=dict)  # "<model>:<adapter>" -> the model serving it
    # on_demand instances not READY (IDLE, or on their way up or down), by served name: what a
    # request starts, and what /v1/models lists as idle or loading.
    standby: dict[str, list[Standby]] = field(default_factory=dict)

    def served_name(self, name: str) -> str:
        """The served name a `model` stands for (itself unless it is an alias or an adapter's)."""
        return self.aliases.get(name) or self.adapters.get(name) or name

    @property
    def backends(self) -> list[Backend]:
        return [b for group in self.by_name.values() for b in group]


def adapter_names(model_name: str, adapters: object) -> list[str]:
    """The served names of a model's LoRA adapters: `<model_name>:<adapter>`."""
    if not isinstance(adapters, list):
        return []
    return [f"{model_name}:{a['name']}" for a in adapters if isinstance(a, dict) and isinstance(a.get("name"), str)]


def _read_rows(paused_s: float = 0.0) -> tuple[list[dict[str, Any]], set[str], list[dict[str, Any]]]:
    """The READY instances on fresh nodes, the names of all instances active, IDLE or meant to run,
    and the on_demand instances that are not READY. `paused_s`: seconds of a database outage just
    over, not counted in a heartbeat's age (none could be written then)."""
    from datetime import timedelta

    from django.db.models import Q
    from django.utils import timezone

    from hardware.models import Node
    from serving.models import ACTIVE_STATES, DesiredState, InstanceState, ModelInstance

    fresh = Node.fresh() if paused_s <= 0 else Node.objects.filter(
        last_heartbeat__gte=timezone.now() - timedelta(seconds=settings.NODE_STALE_AFTER_S + paused_s))
    rows = list(
        ModelInstance.objects.filter(state=InstanceState.READY, node__in=fresh, port__isnull=False)
        .order_by("pk")
        .values("pk", "model_name", "aliases", "type", "backend", "port", "node__name", "node__address",
                "ready_at", "created_at", "policy", "max_concurrency", "first_byte_timeout_s", "backend_key",
                "replica", "gpus", "adapters")
    )
    standby = list(
        ModelInstance.objects.filter(policy="on_demand", state__in=(*ACTIVE_STATES, InstanceState.IDLE))
        .exclude(state=InstanceState.READY, node__in=fresh, port__isnull=False)
        .order_by("pk").values("pk", "model_name", "aliases", "type", "backend", "node__name", "state", "created_at",
                               "adapters"))
    # Known = some instance holds the name or is meant to run: 503 no_backend while it is
    # not READY (loading, restarting after a crash, node offline), 404 only for the rest.
    names: set[str] = set()
    for name, aliases, adapters in (
            ModelInstance.objects.filter(Q(state__in=(*ACTIVE_STATES, InstanceState.IDLE))
                                         | Q(desired_state=DesiredState.RUNNING))
            .values_list("model_name", "aliases", "adapters")):
        names.add(name)
        names.update(aliases or [])  # an alias of a loading model answers 503 like its name
        names.update(adapter_names(name, adapters))
    return rows, names, standby


class RoutingTable:
    """READY backends; re-read in the background (pushed, and every REFRESH_S), single-flight."""

    def __init__(self, *, listen: bool | None = False) -> None:
        self._snapshot: RoutingSnapshot | None = None
        self._fresh = False
        self._loaded_at = 0.0
        self._refresh: asyncio.Task[RoutingSnapshot] | None = None
        self._unavailable: str | None = None  # why the last refresh failed while the database is down
        self._backends: dict[tuple[int, str], Backend] = {}
        self._leaving: dict[tuple[int, str], Backend] = {}  # out of the table, requests still in flight
        self._turn = itertools.count()
        self._listen = listen
        self._listener: asyncio.Task[None] | None = None
        self._loaded: asyncio.Future[None] | None = None  # done by the next read that succeeds (wait_loaded)
        # The staleness clock stops while the database is away (see the module's docstring).
        self._read_ok_at = 0.0  # monotonic: the start of the last read that succeeded
        self._outage_from: float | None = None  # monotonic: since when reads fail (None: they do not)
        self._paused_s = 0.0  # how long the last outage lasted
        self._back_at = 0.0  # monotonic: when the database answered again

    def invalidate(self) -> None:
        """Make the next request wait for a fresh read of the database."""
        self._fresh = False
        self._loaded_at = 0.0

    async def snapshot(self) -> RoutingSnapshot:
        """The current table. Only a process's first request (or one after `invalidate()`) waits."""
        if self._listen or (self._listen is None and settings.PROXY_ROUTING_PUSH):
            self._ensure_listener()
        if self._snapshot is not None and self._fresh and (
                self._listening() or time.monotonic() - self._loaded_at < REFRESH_S):
            return self._snapshot  # (with no background refresh here, re-read at most once per REFRESH_S)
        if self._snapshot is None and self._unavailable is not None and \
                time.monotonic() - self._loaded_at < REFRESH_S:
            raise DatabaseUnavailable(self._unavailable)  # no table yet and the database just failed
        return await self.refresh()

    async def refresh(self) -> RoutingSnapshot:
        """Re-read the database now (one read shared by every caller); the table to serve."""
        task = self._refresh
        loop = asyncio.get_running_loop()
        if task is None or task.done() or task.get_loop() is not loop:
            task = self._refresh = loop.create_task(self._load())
        try:
            # shield: one caller's cancellation (a client gone) must not cancel the shared read.
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except DatabaseUnavailable as exc:
            self._loaded_at = time.monotonic()
            if self._unavailable is None:
                log.warning("routing table refresh failed, the database is unavailable (%s); %s", exc,
                            "keeping the previous table" if self._snapshot else "no table to serve yet")
            self._unavailable = str(exc)
            self._fresh = True  # tried: serve the previous table until the next refresh
            if self._snapshot is None:  # nothing to serve: an empty table would answer 404 for every model
                raise
            return self._snapshot
        except Exception:
            log.exception("routing table refresh failed; keeping the previous table")
            self._loaded_at = time.monotonic()
            if self._snapshot is None:
                self._snapshot = RoutingSnapshot()
            return self._snapshot

    # ------------------------------------------------------------ background refresh
    def _listening(self) -> bool:
        task = self._listener
        return task is not None and not task.done()

    def _ensure_listener(self) -> None:
        loop = asyncio.get_running_loop()
        task = self._listener
        if task is None or task.done() or task.get_loop() is not loop:
            self._listener = loop.create_task(self._background(), name="routing-table-refresh")

    async def _background(self) -> None:
        """Re-read on every `routing.changed` message, and every REFRESH_S without one."""
        from serving.control.events import ROUTING_GROUP

        listener = GroupListener(ROUTING_GROUP)
        while True:
            await listener.receive(REFRESH_S)  # a push, or REFRESH_S without one (or without a layer)
            with contextlib.suppress(DatabaseUnavailable):
                await self.refresh()

    async def stop(self) -> None:
        """Stop the background refresh (process shutdown)."""
        task, self._listener = self._listener, None
        await cancel_and_wait(task)

    def _heartbeat_pause(self, now: float) -> float:
        """Seconds of database outage that do not count against a heartbeat's age now."""
        if self._outage_from is not None:  # this read may end the outage: all of it so far
            return now - self._outage_from
        if now - self._back_at < settings.NODE_STALE_AFTER_S:
            return self._paused_s
        return 0.0  # every heartbeat older than the outage has aged out by now even without it

    async def _load(self) -> RoutingSnapshot:
        started = time.monotonic()
        try:
            rows, names, standby = await run_db(_read_rows, self._heartbeat_pause(started))
        except DatabaseUnavailable:
            if self._outage_from is None:
                # From the last good read, or a refresh before this one (a process that read nothing
                # for long must not forgive heartbeats that went stale before the outage).
                self._outage_from = max(self._read_ok_at, started - REFRESH_S)
            raise
        if self._outage_from is not None:
            self._paused_s, self._back_at, self._outage_from = started - self._outage_from, started, None
        self._read_ok_at = started
        snap = RoutingSnapshot(known_names=frozenset(names))
        for row in standby:
            stamp = row["created_at"]
            entry = Standby(instance_id=row["pk"], model_name=row["model_name"], type=row["type"],
                            backend=row["backend"], node=row["node__name"], state=row["state"],
                            created=int(stamp.timestamp()) if stamp else 0,
                            aliases=tuple(a for a in (row.get("aliases") or []) if isinstance(a, str)))
            snap.standby.setdefault(entry.model_name, []).append(entry)
            for alias in entry.aliases:
                snap.aliases.setdefault(alias, entry.model_name)
            for served in adapter_names(entry.model_name, row.get("adapters")):
                snap.adapters.setdefault(served, entry.model_name)
        kept: dict[tuple[int, str], Backend] = {}
        for row in rows:
            base = f"http://{row['node__address']}:{row['port']}"
            key = (row["pk"], base)
            backend = self._backends.get(key)
            if backend is None:
                stamp = row["ready_at"] or row["created_at"]
                backend = Backend(
                    instance_id=row["pk"], model_name=row["model_name"], type=row["type"],
                    backend=row["backend"], node=row["node__name"], base_url=base,
                    created=int(stamp.timestamp()) if stamp else 0,
                )
            backend.aliases = tuple(a for a in (row.get("aliases") or []) if isinstance(a, str))
            backend.policy = row.get("policy") or "always"
            backend.max_concurrency = row.get("max_concurrency")
            backend.first_byte_timeout_s = row.get("first_byte_timeout_s")
            backend.secret = row.get("backend_key") or ""  # a new one with each launch of the instance
            backend.replica = int(row.get("replica") or 0)
            backend.gpus = tuple(g for g in (row.get("gpus") or []) if isinstance(g, int))
            for alias in backend.aliases:
                snap.aliases.setdefault(alias, backend.model_name)
            backend.adapters = tuple((a["name"], float(a.get("scale", 1.0))) for a in row.get("adapters") or []
                                     if isinstance(a, dict) and isinstance(a.get("name"), str))
            for served in adapter_names(backend.model_name, row.get("adapters")):
                snap.adapters.setdefault(served, backend.model_name)
            kept[key] = backend
            snap.by_name.setdefault(backend.model_name, []).append(backend)
            snap.by_type.setdefault(backend.type, []).append(backend)
        # A replica that left routing (scaled down, draining) while answering stays counted until
        # its requests end: the activity flush reports it in flight (its supervisor waits on that).
        self._leaving = {k: b for k, b in {**self._leaving, **self._backends}.items()
                         if k not in kept and b.in_flight > 0}
        self._backends = kept
        self._snapshot = snap
        self._fresh = True
        if self._unavailable is not None:
            log.info("routing table refreshed again: the database is back")
            self._unavailable = None
        self._loaded_at = time.monotonic()
        loaded, self._loaded = self._loaded, None
        if loaded is not None and not loaded.done():
            loaded.set_result(None)
        return snap

    async def wait_loaded(self, timeout: float) -> None:
        """Until the next read of the database ends (a state change's push starts one at once), or
        `timeout` s: a cold start learns that its instance is READY as soon as this process can."""
        loop = asyncio.get_running_loop()
        if self._loaded is None or self._loaded.get_loop() is not loop:
            self._loaded = loop.create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._loaded), timeout)

    def routed(self, model: str, instance_id: int) -> list[Backend] | None:
        """The model's backends in the last read, when `instance_id` is among them (READY and
        routable): what a cold start waits for, without a read of its own."""
        group = self._snapshot.by_name.get(model) if self._snapshot is not None else None
        return group if group and any(b.instance_id == instance_id for b in group) else None

    def backends(self) -> list[Backend]:
        """Every backend of the current table, and those that left it with requests still in flight."""
        return [*self._backends.values(), *(b for b in list(self._leaving.values()) if b.in_flight > 0)]

    def in_flight_by_instance(self) -> dict[int, int]:
        """Requests in flight per instance id, in this process."""
        counts: dict[int, int] = {}
        for backend in self.backends():
            counts[backend.instance_id] = counts.get(backend.instance_id, 0) + backend.in_flight
        return counts

    def order(self, candidates: list[Backend], key: bytes | None = None) -> list[Backend]:
        """Candidates in the order to try: up before down, then fewest in flight.

        Ties rotate, so idle replicas share sequential traffic instead of the first taking all.
        With a routing key (serving.proxy.prefix) and XGEN_ROUTING=prefix, the first is the up
        replica of highest rendezvous score for the key whose load is within the bound; the rest
        follow as above (where a refused connection goes next).
        """
        n = len(candidates)
        if n == 1:
            return [candidates[0]]  # a new list: callers consume it
        start = next(self._turn) % n
        rotated = candidates[start:] + candidates[:start]
        now = time.monotonic()
        ranked = sorted(rotated, key=lambda b: (b.down_until > now, b.in_flight))
        if key is None or settings.ROUTING != "prefix":
            return ranked
        up = [b for b in candidates if b.down_until <= now]
        if not up:
            return ranked
        cap = load_cap([b.in_flight for b in up], settings.ROUTING_PREFIX_EPS)
        by_score = sorted(up, key=lambda b: score(key, b.instance_id), reverse=True)
        first = next((b for b in by_score if b.in_flight < cap), None)
        if first is None:
            return ranked
        return [first, *(b for b in ranked if b is not first)]


# Listens in servers (settings.PROXY_ROUTING_PUSH); the test settings turn it off for in-process
# tests, whose event loops come and go (a test that wants it makes its own RoutingTable(listen=True)).
routing_table = RoutingTable(listen=None)
