"""On-demand models in the proxy (issue 13): cold starts, the per-model queue, and the record of
when each model was last asked for.

- A request for a model whose replicas are all IDLE starts one (serving.control.starts.start_idle:
  desired RUNNING in the database, the node nudged, exactly like a click), once per model however
  many requests wait in this process, and waits for READY by reading the row. Other web processes
  that see the instance already starting only wait.
- A model whose replicas have `max_concurrency` admits that many requests per replica at once;
  the rest wait in a queue, by the keys' priority (higher first), then round robin among the
  keys waiting (ModelGate), at most XGEN_QUEUE_MAX long and XGEN_QUEUE_TIMEOUT_S each: beyond
  either, 429 queue_full (a full queue first makes room for a key holding fewer places than the
  one holding the most). In embedded mode the queue is this process's; in cluster mode
  (REDIS_URL) it and max_concurrency are the cluster's (serving.proxy.cluster_admission).
- The last request time of on_demand instances goes to the database every ACTIVITY_FLUSH_S
  (instances with requests open count as used), off the request path; the node's supervisor
  unloads on it, and eviction orders by it. In the same flush, the requests in flight per
  replica and queued per model (InFlightReport, issue 30): the autoscaler's load, what a replica
  scaled down waits for, and what eviction never takes.
"""
from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from django.conf import settings

from accounts.credentials import Principal
from live.db import run_db
from live.tasks import cancel_and_wait
from serving.proxy import metrics
from serving.proxy.cluster_admission import (
    AdmissionUnavailable,
    ClusterAdmission,
    cluster_admission,
    unavailable_error,
)
from serving.proxy.cluster_admission import current as _shared_admission
from serving.proxy.errors import ProxyError
from serving.proxy.replicas import Backend, RoutingSnapshot, Standby, routing_table

log = logging.getLogger("xgen.proxy")

POLL_S = 0.1
ERROR_GRACE_S = 3.0  # an ERROR the agent does not leave within this long ends the wait (cold_start_failed)
# What the SSE comments say while a model loads: a rough share of the way by state.
STATE_PCT = {"IDLE": 0, "PENDING": 2, "CACHING": 5, "LOADING": 50, "WARMING": 90, "READY": 100}


# ---------------------------------------------------------------- activity
class Activity:
    """When this process last sent a request to each on_demand instance; written in batches."""

    def __init__(self) -> None:
        self._touched: dict[int, float] = {}
        self._task: asyncio.Task | None = None
        self._reported: set[str] = set()  # models last reported with a load (written once more at 0)

    def touch(self, backend: Backend) -> None:
        if backend.policy == "on_demand":
            self._touched[backend.instance_id] = time.time()

    def ensure_started(self) -> None:
        task = self._task
        loop = asyncio.get_running_loop()
        if task is None or task.done() or task.get_loop() is not loop:
            self._task = loop.create_task(self._run(), name="on-demand-activity")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(settings.ACTIVITY_FLUSH_S)
            with contextlib.suppress(Exception):
                await self.flush()

    async def flush(self) -> None:
        touched, self._touched = self._touched, {}
        now = time.time()
        for backend in routing_table.backends():  # a long answer still in flight is use
            if backend.in_flight > 0 and backend.policy == "on_demand":
                touched[backend.instance_id] = now
        if touched:
            try:
                await run_db(_write_activity, touched)
            except Exception:
                for pk, at in touched.items():
                    self._touched.setdefault(pk, at)
                raise
        await self.report_load()

    async def report_load(self) -> None:
        """This process's requests in flight (per replica) and queued per model (issue 30): what the
        autoscaler sums, and what a replica being drained or a start's eviction looks at (a replica
        that left routing still counts until its requests end). Models with a load are written,
        and once more at 0 those that had one."""
        loads: dict[str, tuple[int, int, dict[str, int]]] = {}
        for backend in routing_table.backends():
            if backend.in_flight > 0:
                flying, queued, per = loads.get(backend.model_name, (0, 0, {}))
                per[str(backend.instance_id)] = per.get(str(backend.instance_id), 0) + backend.in_flight
                loads[backend.model_name] = (flying + backend.in_flight, queued, per)
        for model, gate in list(_gates.items()):
            if gate.waiting:
                flying, _, per = loads.get(model, (0, 0, {}))
                loads[model] = (flying, gate.waiting, per)
        for model in self._reported - set(loads):
            loads[model] = (0, 0, {})
        if loads:
            await run_db(_write_reports, PROCESS, loads)
        self._reported = {model for model, (flying, queued, _) in loads.items() if flying or queued}

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        with contextlib.suppress(Exception):
            await self.flush()


def _write_activity(touched: dict[int, float]) -> None:
    from serving.models import ModelInstance

    for pk, at in touched.items():
        ModelInstance.objects.filter(pk=pk).update(last_request_at=datetime.fromtimestamp(at, UTC))


def _write_reports(process: str, loads: dict[str, tuple[int, int, dict[str, int]]]) -> None:
    from django.utils import timezone

    from serving.models import InFlightReport

    now = timezone.now()
    for model, (flying, queued, per) in loads.items():
        InFlightReport.objects.update_or_create(process=process, model_name=model, defaults={
            "in_flight": flying, "queued": queued, "instances": per, "at": now})


PROCESS = f"{socket.gethostname()}:{os.getpid()}"
activity = Activity()


# ---------------------------------------------------------------- cold starts
@dataclass
class ColdStart:
    """One model's start, shared by every request waiting for it in this process."""

    model: str
    began: float = field(default_factory=time.perf_counter)
    state: str = "IDLE"
    progress: float | None = None
    task: asyncio.Task | None = None

    @property
    def pct(self) -> int:
        base = STATE_PCT.get(self.state, 0)
        if self.state == "CACHING" and self.progress is not None:
            return int(5 + 0.45 * self.progress)
        return base


_starts: dict[str, ColdStart] = {}


def cold_start_timeout(standby: list[Standby]) -> float:
    """XGEN_COLD_START_TIMEOUT_S, or the backend's load timeout (plus the warm-up)."""
    if settings.COLD_START_TIMEOUT_S:
        return float(settings.COLD_START_TIMEOUT_S)
    from serving.adapters import ADAPTERS

    adapter = ADAPTERS.get(standby[0].backend) if standby else None
    return float(adapter.load_timeout_s() if adapter else settings.LOAD_TIMEOUT_LLAMA_S) + 30


def _start_one(ids: list[int]) -> tuple[int | None, str]:
    """Start the first IDLE instance of `ids` unless one of them is on its way up already."""
    from serving.control.capacity import NoRoom
    from serving.control.starts import start_idle
    from serving.models import ACTIVE_STATES, DesiredState, ModelInstance

    rows = list(ModelInstance.objects.filter(pk__in=ids).order_by("pk").values_list("pk", "state", "desired_state"))
    for pk, state, desired in rows:
        if state in ACTIVE_STATES and desired == DesiredState.RUNNING:
            return pk, state  # started already (another request, another process, the Start button)
    for pk, state, _ in rows:
        if state == "IDLE":
            try:
                inst = start_idle(instance_id=pk)
            except NoRoom as exc:
                raise ProxyError(503, f"{exc.message}.", code="insufficient_capacity",
                                 headers=[(b"retry-after", b"5")]) from None
            return inst.pk, inst.state
    if any(state in ACTIVE_STATES for _, state, _ in rows):
        return None, "UNLOADING"  # on its way back to IDLE (idle unload, eviction): started once it is there
    states = ", ".join(sorted({state for _, state, _ in rows})) or "gone"
    raise ProxyError(503, f"The model cannot be started: its instance is {states}.", code="cold_start_failed")


def _states(ids: list[int]) -> list[tuple[int, str, str, float | None, str, str]]:
    from serving.models import ModelInstance

    return list(ModelInstance.objects.filter(pk__in=ids).values_list(
        "pk", "state", "desired_state", "progress_pct", "state_message", "last_error"))


async def _run_start(start: ColdStart, standby: list[Standby]) -> list[Backend]:
    ids = [s.instance_id for s in standby]
    deadline = time.monotonic() + cold_start_timeout(standby)
    started_id, start.state = await run_db(_start_one, ids)
    while started_id is None:  # stopping: wait until it is IDLE, then start it
        if time.monotonic() > deadline:
            raise ProxyError(503, f"The model '{start.model}' is still stopping.", code="cold_start_failed")
        await asyncio.sleep(POLL_S)
        started_id, start.state = await run_db(_start_one, ids)
    routing_table.invalidate()  # every process's table shows it loading (pushed on its state changes)
    seen_up = False
    error_since: float | None = None
    while True:
        group = routing_table.routed(start.model, started_id)  # the pushed read that woke us has it READY
        if group:
            return group
        rows = await run_db(_states, ids)
        mine = next((r for r in rows if r[0] == started_id), None)
        if mine is None:
            raise ProxyError(503, f"The instance of '{start.model}' was deleted while it started.",
                             code="cold_start_failed")
        _, state, desired, progress, message, last_error = mine
        start.state, start.progress = state, progress
        if state == "READY":
            routing_table.invalidate()
            snap = await routing_table.refresh()
            group = snap.by_name.get(start.model)
            if group:
                return group
        elif state == "ERROR" and desired == "RUNNING" and time.monotonic() - (error_since or time.monotonic()) \
                < ERROR_GRACE_S:
            # The agent may still move on from it: the node's next backend (issue 12 #3), a restart.
            error_since = error_since or time.monotonic()
        elif state == "ERROR" or (state == "STOPPED" and desired != "RUNNING") or (state == "IDLE" and seen_up):
            # (STOPPED and meant to run: a restarted agent found the half-started backend and starts it again)
            reason = last_error or message or state
            raise ProxyError(503, f"The model '{start.model}' could not be started: {reason[:400]}",
                             code="cold_start_failed")
        elif state != "IDLE":
            seen_up = True
        if state != "ERROR":
            error_since = None
        if time.monotonic() > deadline:
            raise ProxyError(503, f"The model '{start.model}' did not become ready within "
                                  f"{cold_start_timeout(standby):g} s (it is {state}: {message[:200]}).",
                             code="cold_start_failed")
        # Each state change is pushed to every routing table, which reads the database at once:
        # woken by that read, a start sees READY tens of ms sooner than a 0.1 s poll would.
        await routing_table.wait_loaded(POLL_S)


def starting(model: str) -> ColdStart | None:
    return _starts.get(model)


async def cold_start(model: str, standby: list[Standby]) -> tuple[ColdStart, asyncio.Task]:
    """The shared start of `model` (begun now unless one is under way here)."""
    start = _starts.get(model)
    loop = asyncio.get_running_loop()
    if start is None or start.task is None or start.task.done() or start.task.get_loop() is not loop:
        start = _starts[model] = ColdStart(model=model)
        start.task = loop.create_task(_run_start(start, standby), name=f"cold-start-{model}")
        metrics.COLD_STARTS.labels(model).inc()

        def done(task: asyncio.Task, start: ColdStart = start) -> None:
            if _starts.get(model) is start:
                _starts.pop(model, None)
            if not task.cancelled() and task.exception() is None:
                metrics.COLD_START_SECONDS.labels(model).observe(time.perf_counter() - start.began)
            elif not task.cancelled():
                metrics.COLD_START_FAILED.labels(model).inc()

        start.task.add_done_callback(done)
    return start, start.task


def needs_cold_start(snap: RoutingSnapshot, served: str) -> list[Standby] | None:
    """The standby instances of `served` when none of its replicas is READY."""
    if snap.by_name.get(served):
        return None
    return snap.standby.get(served) or None


# ---------------------------------------------------------------- the queue
@dataclass
class Slot:
    gate: ModelGate | None
    acquired: float = field(default_factory=time.perf_counter)
    released: bool = False

    def release(self) -> None:
        if self.gate is not None and not self.released:
            self.released = True
            self.gate.release(time.perf_counter() - self.acquired)


NO_SLOT = Slot(gate=None)


@dataclass
class ClusterSlot(Slot):
    """A slot leased in Redis (cluster mode): released through the process's ClusterAdmission."""
    shared: ClusterAdmission | None = None
    key: str = ""
    lease: str = ""

    def release(self) -> None:
        if self.shared is not None and not self.released:
            self.released = True
            self.shared.release(self.key, self.lease)


@dataclass(eq=False)
class _Waiter:
    owner: str
    future: asyncio.Future


class ModelGate:
    """max_concurrency for one served name in this process, and its queue.

    The queue is shared fairly among the keys that wait in it (issue 23): within a priority, a
    key's n-th waiting request goes after every other key's (n-1)-th (round robin, not first come
    first served), and a full queue makes room for a key holding fewer places than the one
    holding the most, whose newest waiter is answered 429 queue_full. One key flooding a model
    can neither shut the others out of its queue nor keep them at its back."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.active = 0
        self.capacity = 1
        self.waiting = 0
        self._heap: list[tuple[int, int, int, _Waiter]] = []
        self._by_owner: dict[str, list[_Waiter]] = {}  # each owner's waiters, oldest first
        self._seq = itertools.count()
        self.hold_s = 1.0  # a moving average of how long a request holds a slot (for Retry-After)
        self.closed = False  # the process is shutting down: nothing more waits here

    def retry_after(self) -> int:
        return max(1, math.ceil(self.hold_s * (self.waiting + 1) / max(self.capacity, 1)))

    def _full(self, why: str) -> ProxyError:
        metrics.QUEUE_REJECTED.labels(self.model).inc()
        return ProxyError(429, f"The queue for '{self.model}' is full ({why}); try again later.", code="queue_full",
                          headers=[(b"retry-after", str(self.retry_after()).encode())])

    def _make_room_for(self, owner: str) -> bool:
        """Push out the newest waiter of the owner holding the most places, when it holds more
        than `owner` would with one more; False when the queue is shared fairly already."""
        mine = len(self._by_owner.get(owner, ()))
        heaviest = max(self._by_owner, key=lambda o: len(self._by_owner[o]), default=None)
        if heaviest is None or heaviest == owner or len(self._by_owner[heaviest]) <= mine + 1:
            return False
        victim = self._by_owner[heaviest][-1]
        self._forget(victim)
        self.waiting -= 1
        victim.future.set_exception(self._full(
            f"a key with fewer places needed one; this key held {len(self._by_owner.get(heaviest, ())) + 1} of "
            f"{settings.QUEUE_MAX}"))
        return True

    def _forget(self, waiter: _Waiter) -> None:
        mine = self._by_owner.get(waiter.owner)
        if mine is not None:
            with contextlib.suppress(ValueError):
                mine.remove(waiter)
            if not mine:
                del self._by_owner[waiter.owner]

    async def acquire(self, capacity: int, priority: int, owner: str = "") -> Slot:
        self.capacity = capacity
        if self.active < capacity and not self.waiting:
            self.active += 1
            return Slot(gate=self)
        if self.closed:
            raise _shutting_down()
        if self.waiting >= settings.QUEUE_MAX and not self._make_room_for(owner):
            raise self._full(f"{self.waiting} requests wait, XGEN_QUEUE_MAX is {settings.QUEUE_MAX}")
        waiter = _Waiter(owner=owner, future=asyncio.get_running_loop().create_future())
        rank = len(self._by_owner.setdefault(owner, []))
        self._by_owner[owner].append(waiter)
        heapq.heappush(self._heap, (-priority, rank, next(self._seq), waiter))
        self.waiting += 1
        metrics.QUEUE_DEPTH.labels(self.model).set(self.waiting)
        waited_from = time.perf_counter()
        try:
            async with asyncio.timeout(settings.QUEUE_TIMEOUT_S):
                await waiter.future
        except TimeoutError:
            self._leave(waiter)
            raise self._full(f"waited {settings.QUEUE_TIMEOUT_S} s, XGEN_QUEUE_TIMEOUT_S") from None
        except asyncio.CancelledError:  # the client left while queued
            self._leave(waiter)
            raise
        finally:
            metrics.QUEUE_WAIT.labels(self.model).observe(time.perf_counter() - waited_from)
            metrics.QUEUE_DEPTH.labels(self.model).set(self.waiting)
        return Slot(gate=self)

    def _leave(self, waiter: _Waiter) -> None:
        fut = waiter.future
        if fut.done() and not fut.cancelled():
            if fut.exception() is None:
                self.release(None)  # it was handed a slot as it left: pass it on
            return  # (pushed out: counted then)
        if not fut.done():
            fut.cancel()
        self._forget(waiter)
        self.waiting -= 1

    def close(self) -> int:
        """Answer every waiter 503 shutting_down (the process stops: what waits would only be cut
        off when the server gives up on it); later requests that would wait get the same. Returns
        how many were waiting."""
        self.closed = True
        waiters = [w for _, _, _, w in self._heap if not w.future.done()]
        self._heap.clear()
        self._by_owner.clear()
        self.waiting = 0
        for waiter in waiters:
            waiter.future.set_exception(_shutting_down())
        metrics.QUEUE_DEPTH.labels(self.model).set(0)
        return len(waiters)

    def release(self, held_s: float | None) -> None:
        if held_s is not None:
            self.hold_s = 0.8 * self.hold_s + 0.2 * held_s
        self.active -= 1
        while self._heap and self.active < self.capacity:
            _, _, _, waiter = heapq.heappop(self._heap)
            if waiter.future.done():
                continue  # left or pushed out already (counted then)
            self._forget(waiter)
            self.waiting -= 1
            self.active += 1
            waiter.future.set_result(True)
            return


_gates: dict[str, ModelGate] = {}


def capacity_of(backends: list[Backend]) -> int | None:
    """Requests the replicas serve at once (None: no limit, no queue)."""
    if not backends:
        return None
    total = 0
    for b in backends:
        if b.max_concurrency is None:
            return None
        total += b.max_concurrency
    return total


async def admit(model: str, backends: list[Backend], priority: int, owner: str = "") -> Slot:
    """A slot for one request to `model` (waiting in its queue while the replicas are full);
    `owner` names whose request it is (queue_owner) for the queue's fair share."""
    capacity = capacity_of(backends)
    if capacity is None:
        return NO_SLOT
    shared = cluster_admission()
    if shared is not None:  # cluster mode: the slots and the queue are the cluster's, in Redis
        if _closing[0]:
            raise _shutting_down()
        try:
            key, lease = await shared.acquire(model, capacity, priority)
            return ClusterSlot(gate=None, shared=shared, key=key, lease=lease)
        except AdmissionUnavailable:
            mode = settings.ADMISSION_ON_REDIS_ERROR
            metrics.ADMISSION_REDIS_FALLBACK.labels(mode).inc()
            if mode == "refuse":
                raise unavailable_error() from None
    gate = _gates.get(model)
    if gate is None:
        gate = _gates[model] = ModelGate(model)
    return await gate.acquire(capacity, priority, owner)


def queue_owner(principal: Principal | None, client: str = "") -> str:
    """Whose request it is, for the queue's fair share: the key, else the signed-in user, else the
    client address."""
    if principal is None:
        return f"addr:{client}"
    return f"key:{principal.key_id}" if principal.key_id else f"user:{principal.user_id}"


def _shutting_down() -> ProxyError:
    return ProxyError(503, "The console is shutting down; try again in a moment.", code="shutting_down",
                      headers=[(b"retry-after", b"2")])


_closing = [False]


def close_queues() -> int:
    """At shutdown (SIGTERM): every model's queue answers its waiters 503 at once, instead of
    their waiting for slots that the streams in flight hold until the server's grace runs out.
    Returns how many were waiting."""
    _closing[0] = True
    shared = _shared_admission()
    return (shared.close_waiters(_shutting_down()) if shared is not None else 0) + sum(
        gate.close() for gate in list(_gates.values()))


def shutting_down() -> bool:
    """Whether this process was told to stop (close_queues ran)."""
    return _closing[0]


def queue_depth(model: str) -> int:
    gate = _gates.get(model)
    shared = _shared_admission()
    return (gate.waiting if gate else 0) + (shared.waiting(model) if shared is not None else 0)
