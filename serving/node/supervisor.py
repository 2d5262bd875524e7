"""The supervisor: the node agent's worker that owns backend processes on its node.

Controller pattern: the database holds each instance's desired state; `reconcile()` makes
the processes match (a nudge runs it at once, and it runs every RECONCILE_INTERVAL_S).

One instance, one `BackendRun`: its lifecycle task walks PENDING -> CACHING -> LOADING ->
WARMING -> READY from the instance's LaunchPlan, then watches the process; a crash of a READY
backend goes to ERROR and is restarted with exponential backoff. Process work (spawning into
its own session, killing the group) is serving.node.processes; following the log file into
the page and the database is serving.node.logs.LogTailer. Stopping kills first, from what is
known here, and records afterwards: a database that fails never keeps a backend running.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from django.conf import settings
from django.utils import timezone

from hardware.backends import export_llama_cpp_lib_path, waiting_build
from hardware.models import Node
from hardware.process_memory import gpu_leaks, gpu_memory_by_pid, group_pids, measure_group
from hub import layout
from hub.cache import resolve_model_path, sync_to_cache
from hub.store import StoreUnreachable
from live.db import db_async
from live.tasks import cancel_and_wait
from serving.adapters import BackendAdapter, get_adapter
from serving.adapters.base import backend_environment
from serving.control import events
from serving.control.capacity import has_requests_in_flight
from serving.control.lora import LoadRefused as AdapterRefused
from serving.control.lora import check_gguf_adapter, check_peft_folder, is_stored
from serving.control.placement import PlacementError, bind_host, pick_port
from serving.control.planning import (
    KEY_FILE_SLOT,
    LaunchPlan,
    LoadRefused,
    check_load_path_or_refuse,
    fallback_plan,
    plan_for_instance,
    record_measurement,
    stored_plan,
)
from serving.control.relocation import relocate
from serving.control.services import instances_for_node, save_log_tail, start_again
from serving.models import (
    ACTIVE_STATES,
    TRANSITIONS,
    DesiredState,
    IllegalTransition,
    InstanceState,
    ModelInstance,
    Policy,
)
from serving.node.logs import TAIL_POLL_S, LogTailer, current_log, previous_log
from serving.node.processes import (
    BackendProcess,
    backend_key_file,
    describe_exit,
    listener_is_ours,
    pid_alive,
    proc_cmdline,
    spawn_backend,
    url_host,
    write_key_file,
)
from serving.node.workers import Agent, AgentWorker

log = logging.getLogger("xgen.supervisor")

HEALTH_POLL_S = 0.25
DRAIN_SETTLE_S = 1.0  # a stop waits this long before it asks a backend for its requests in flight
DRAIN_POLL_S = 0.25
DRAIN_ASK_TIMEOUT_S = 2.0
# Health polls while a backend starts. Until its port listens, a bare TCP connect every 10 ms for
# its first 10 s (tens of microseconds of CPU: an HTTP request to a closed port every 10 ms took
# CPU from llama-cpp-python's own start, +50 ms of its 600 ms on 2 cores, so it was polled every
# 50 ms, and a load waited 25 ms for its poll on average; llama-cpp-python opens its port only once
# the model is loaded). Once it listens, the HTTP health route every 10 ms for its first 2 s
# (llama-server answers 503 "loading" a few ms after the spawn; at 50 ms a poll the wait after the
# 503 cost 54-60 ms of a 180-360 ms load, traced). After that, HEALTH_POLL_S.
HEALTH_POLL_ANSWERING_S, ANSWERING_FAST_FOR_S = 0.01, 2.0
PORT_POLL_S, STARTING_FAST_FOR_S = 0.01, 10.0


def health_poll_s(elapsed: float, *, answering: bool) -> float:
    """Seconds before the next poll of a backend started `elapsed` s ago; `answering`: its port
    has given an HTTP answer (not yet 200), else it is probed with a bare connect first."""
    if answering and elapsed < ANSWERING_FAST_FOR_S:
        return HEALTH_POLL_ANSWERING_S
    return PORT_POLL_S if elapsed < STARTING_FAST_FOR_S else HEALTH_POLL_S


async def port_listens(host: str, port: int, *, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections on host:port (a connect, closed at once)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, (host.strip("[]"), port))
        return True
    except (OSError, TimeoutError):
        return False
    finally:
        sock.close()


WARMUP_TIMEOUT_S = 120
PROGRESS_EVERY_S = 0.5
# How often a start that waits for a llama.cpp build looks at it again.
BUILD_POLL_S = 1.0

LOADED, LOAD_FAILED, CRASHED, STOPPED = "loaded", "load_failed", "crashed", "stopped"
STORE_DOWN = "store_down"
STORE_RETRY_MAX_S = 60  # a store that comes back is noticed within a minute, however long it was away


class LoadFailed(Exception):
    """The backend could not be started or did not become ready (message for the page)."""


class StoreDown(LoadFailed):
    """The copy into the cache failed because the store could not be reached: tried again later."""


def store_retry_delay(retries: int) -> float:
    """Seconds before store try `retries + 1`: the crash backoff (XGEN_RESTART_BACKOFF doubling),
    at least 1 s (a backoff of 0 must not hammer a dead store), at most STORE_RETRY_MAX_S."""
    return float(min(STORE_RETRY_MAX_S, max(1, settings.RESTART_BACKOFF_S) * 2 ** min(retries, 16)))


def _db(fn):
    """`fn` through the one DB bridge, in asgiref's one shared thread (thread_sensitive): the
    supervisor's writes then land in the order it makes them (a cache-progress update sent from
    the copy thread can never overtake the LOADING transition that follows it)."""
    return db_async(fn, thread_sensitive=True)


def _get(instance_id: int) -> ModelInstance | None:
    return ModelInstance.objects.select_related("node").filter(pk=instance_id).first()


def _mark(instance_id: int, mark, *args, **kwargs) -> ModelInstance:
    """Apply one of ModelInstance's state changes (`ModelInstance.mark_ready`, ...) to the instance."""
    return mark(ModelInstance.objects.select_related("node").get(pk=instance_id), *args, **kwargs)


def _waiting(instance_id: int, message: str, pct: float | None) -> None:
    inst = _get(instance_id)
    if inst is not None:
        inst.set_waiting(message, pct)


def _progress(instance_id: int, pct: float) -> None:
    inst = _get(instance_id)
    if inst is not None:
        inst.set_progress(pct)


def _ports_taken(inst: ModelInstance) -> set[int]:
    """Ports the other instances on the instance's node's address hold (agents may share a host)."""
    return set(ModelInstance.objects.filter(node__address=inst.node.address, state__in=ACTIVE_STATES,
                                            port__isnull=False).exclude(pk=inst.pk).values_list("port", flat=True))


def _leaving(node_name: str, instance_id: int) -> int:
    """Instances of the node on their way out (desired state no longer RUNNING), but this one."""
    return ModelInstance.objects.filter(node__name=node_name, state__in=ACTIVE_STATES).exclude(
        desired_state=DesiredState.RUNNING).exclude(pk=instance_id).count()


def _launch_facts(instance_id: int, node_name: str) -> tuple[ModelInstance | None, set[int] | None, int | None]:
    """What a start reads before it spawns, in one trip to the database: the row (its node with
    it), the ports taken on its address, and how many of the node's instances are leaving."""
    inst = _get(instance_id)
    if inst is None:
        return None, None, None
    return inst, _ports_taken(inst), _leaving(node_name, instance_id)


db_get = _db(_get)
db_mark = _db(_mark)
db_progress = _db(_progress)
db_save_tail = _db(save_log_tail)


@dataclass
class BackendRun:
    """One instance's process on this node, as far as the supervisor knows it (enough to kill it
    without asking the database)."""

    instance_id: int
    adapter: BackendAdapter | None = None
    plan: LaunchPlan | None = None
    port: int | None = None
    picked_port: int | None = None  # chosen, the process not started yet: no other launch may take it
    host: str = "127.0.0.1"
    process: BackendProcess | None = None
    adopted: bool = False
    answered: bool = False  # its port gave an HTTP answer while it started (health polls come faster)
    stopping: bool = False
    tailer: LogTailer | None = None
    cancel_copy: threading.Event | None = None  # set to stop a copy into the cache
    lifecycle: asyncio.Task | None = None
    stopper: asyncio.Task | None = None
    did_not_come_up: str = ""  # why the last start failed (exited, never healthy, warm-up), with its last line
    store_down: str = ""  # why the last copy from the store failed, when the store could not be reached
    pids: list[int] = field(default_factory=list)  # the group's processes when last measured
    secret: str = field(default="", repr=False)  # the bearer token the backend requires (made at launch)

    @property
    def headers(self) -> dict[str, str]:
        """What the agent's own requests to the backend carry (health, warm-up, adoption)."""
        return {"Authorization": f"Bearer {self.secret}"} if self.secret else {}

    def last_lines(self, n: int = 12) -> str:
        return self.tailer.last_lines(n) if self.tailer else ""

    @property
    def tail(self) -> list[str]:
        return list(self.tailer.tail) if self.tailer else []

    def exited(self) -> bool:
        return self.process is None or self.process.exited()


class Supervisor(AgentWorker):
    """Starts, watches and stops the backend processes of this node's instances."""

    name = "supervisor"

    def __init__(self) -> None:
        self.runs: dict[int, BackendRun] = {}
        self.http: httpx.AsyncClient | None = None
        self.agent: Agent | None = None
        self.closing = False

    # ------------------------------------------------------------ agent hooks
    async def start(self, agent: Agent) -> None:
        self.agent = agent
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=2.0), trust_env=False)
        await self.adopt_or_stop_orphans()
        await self.reconcile()
        # Autostart instances are part of a started agent: wait until each settles.
        autostart = await _db(lambda: set(ModelInstance.objects.filter(
            node__name=agent.name, autostart=True, desired_state=DesiredState.RUNNING).values_list("pk", flat=True)))()
        waits = [self._settled(r) for pk, r in self.runs.items() if pk in autostart]
        if waits:
            await asyncio.gather(*waits)

    async def run(self, agent: Agent) -> None:
        while True:
            try:
                await self.reconcile()
            except Exception:
                log.exception("reconcile failed; retrying")
            await agent.wait_for_nudge(settings.RECONCILE_INTERVAL_S)

    async def stop(self, agent: Agent) -> None:
        """Stop every backend this agent runs. Autostart instances start again with the next agent;
        the others stay stopped (an on_demand one goes back to IDLE, started by the next request)."""
        self.closing = True
        if agent.displaced is not None:
            await self._abandon(agent)
            return
        await self.move_off(agent)
        await self.drain()
        try:
            rows = await _db(lambda: {pk: (auto, policy, desired, message) for pk, auto, policy, desired, message
                                      in ModelInstance.objects.filter(pk__in=list(self.runs)).values_list(
                                          "pk", "autostart", "policy", "desired_state", "state_message")})()
        except Exception:  # the database is down: stop everything, keep what the rows say
            log.warning("could not read which instances autostart; all are stopped as they are", exc_info=True)
            rows = {}
        stops = []
        for pk, run in list(self.runs.items()):
            if run.stopper is not None:
                stops.append(run.stopper)
                continue
            autostart, policy, desired, message = rows.get(pk, (True, Policy.ALWAYS, DesiredState.RUNNING, ""))
            if desired == DesiredState.STOPPED:  # moved to another node (move_off), or unloaded meanwhile
                stops.append(self.stop_instance(pk, message or "node agent stopped"))
            elif autostart:
                stops.append(self.stop_instance(pk, "node agent stopped (autostart: starts with the next agent)",
                                                keep_desired=True))
            elif policy == Policy.ON_DEMAND:
                stops.append(self._leave(pk, DesiredState.IDLE, "node agent stopped: idle until the next request",
                                         to_idle=True))
            else:
                stops.append(self._leave(pk, DesiredState.STOPPED,
                                         "node agent stopped (not marked autostart: stays stopped; Restart starts it)"))
        await asyncio.gather(*stops, return_exceptions=True)
        if self.http is not None:
            await self.http.aclose()

    async def move_off(self, agent: Agent) -> None:
        """A stop drains the node (issue 31 #4): before its backends leave routing, the replicas it
        serves that the desired counts still want are placed on the other online nodes, as an
        offline node's are (serving.control.relocation); the ones placed are stopped here after their
        drain and stay stopped when an agent comes back. Nothing fits elsewhere: they stay as the
        rest (autostart, on_demand and the others, below)."""
        try:
            # Stored first: from here no load, replica or relocation is placed on this node.
            # One trip to the database thread: the drain's first step (UNLOADING) waits on this.
            def mark() -> tuple[Node | None, bool]:
                Node.objects.filter(name=agent.name).update(draining_since=timezone.now())
                return (Node.objects.filter(name=agent.name).first(),
                        Node.placeable().exclude(name=agent.name).exists())
            node, others = await _db(mark)()
            if node is None or not others:  # one node (the embedded mode): nowhere to move to
                return
            moved = await _db(relocate)(node, why="draining (its agent got SIGTERM)", out_of_routing=False)
        except Exception:
            log.warning("could not move this node's models to other nodes", exc_info=True)
            return
        for m in moved:
            log.info("draining: %s (instance %s) moved to %s (instance %s)", m.model_name, m.old.pk,
                     m.new.node.name, m.new.pk)

    async def drain(self) -> None:
        """A stop's first step (SIGTERM: a deleted pod, a rolling update, `systemctl stop`): each READY
        backend leaves routing (UNLOADING: web processes send it nothing new) and gets up to
        XGEN_SHUTDOWN_GRACE_S to finish the requests it is answering, as its engine counts them
        (llama-server's /slots, vLLM's /metrics; one that cannot say is not waited for)."""
        candidates = {pk: run for pk, run in self.runs.items() if run.stopper is None and not run.stopping
                      and run.port and run.adapter is not None and run.adapter.busy_path and not run.exited()}
        if not candidates or self.http is None:
            return
        try:
            ready = set(await _db(lambda: list(ModelInstance.objects.filter(
                pk__in=list(candidates), state=InstanceState.READY).values_list("pk", flat=True)))())
        except Exception:
            log.warning("could not read which backends are READY; stopping without draining", exc_info=True)
            return
        pending = {pk: run for pk, run in candidates.items() if pk in ready}
        if not pending:
            return
        await asyncio.gather(*(self._record(pk, ModelInstance.mark_unloading,
                                            "node agent stopping: finishing the requests in flight")
                               for pk in pending))
        started = time.monotonic()
        deadline = started + settings.SHUTDOWN_GRACE_S
        await asyncio.sleep(min(DRAIN_SETTLE_S, settings.SHUTDOWN_GRACE_S))  # a request routed just before
        while pending and time.monotonic() < deadline:
            counts = await asyncio.gather(*(self._in_flight(run) for run in pending.values()))
            for (pk, run), count in zip(list(pending.items()), counts, strict=True):
                if not count or run.exited():  # 0, or the engine cannot say (None)
                    pending.pop(pk)
            if pending:
                await asyncio.sleep(DRAIN_POLL_S)
        waited = time.monotonic() - started
        if pending:
            log.warning("stopping with requests still in flight on instances %s after %.0f s (XGEN_SHUTDOWN_GRACE_S)",
                        sorted(pending), waited)
        else:
            log.info("the node's backends finished their requests in flight (%.1f s)", waited)

    async def _drain_and_stop(self, run: BackendRun, until) -> None:
        """A replica scaled down (issue 30): out of routing already (UNLOADING), it finishes the
        requests it is answering, then stops; at `until` it stops whatever is left."""
        waited, left = await self._drained(run, until, while_desired=DesiredState.STOPPED)
        await self.stop_instance(run.instance_id, f"scaled down: drained in {waited:.1f} s{left}")

    async def _drained(self, run: BackendRun, until, *, while_desired: str) -> tuple[float, str]:
        """Wait until the backend answers no request, as its engine counts them and as the web
        processes report them (their InFlightReport, written each ACTIVITY_FLUSH_S), at most until
        `until` (or until its desired state is no longer `while_desired`): (seconds, "" or why)."""
        deadline = time.monotonic() + max(0.0, (until - timezone.now()).total_seconds())
        started = time.monotonic()
        # A request routed just before the replica left routing is in the web processes' reports
        # once each has flushed after it began (a process with requests in flight writes every
        # ACTIVITY_FLUSH_S): wait for the routing push and one flush before believing a 0.
        settle = DRAIN_SETTLE_S + settings.ACTIVITY_FLUSH_S
        await asyncio.sleep(min(settle, max(0.0, deadline - started)))
        while time.monotonic() < deadline and not run.exited():
            engine = await self._in_flight(run) if run.port and run.adapter and run.adapter.busy_path else None
            inst = await db_get(run.instance_id)
            if inst is None or inst.desired_state != while_desired:
                break
            if not engine and not await _db(has_requests_in_flight)(inst):
                break
            await asyncio.sleep(DRAIN_POLL_S)
        waited = time.monotonic() - started
        return waited, "" if time.monotonic() < deadline else "; drain timeout reached"

    async def _in_flight(self, run: BackendRun) -> int | None:
        try:
            r = await self.http.get(f"http://{url_host(run.host)}:{run.port}{run.adapter.busy_path}", headers=run.headers,
                                    timeout=DRAIN_ASK_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        return run.adapter.requests_in_flight(r.content) if r.status_code == 200 else None

    async def _abandon(self, agent: Agent) -> None:
        """Another agent took the node: its rows are the new holder's, so none is written here.
        On the same host the new agent adopted (or stopped) these backends already: leave them;
        on another host they are orphans that would hold this host's memory: kill them."""
        same_host = agent.displaced.holder_host == agent.host
        for run in list(self.runs.values()):
            run.stopping = True
            if run.lifecycle is not None and not run.lifecycle.done():
                await cancel_and_wait(run.lifecycle)
            if not same_host:
                with contextlib.suppress(Exception):
                    await self._kill(run)
            with contextlib.suppress(Exception):
                await self._stop_tailer(run)
        self.runs.clear()
        if self.http is not None:
            await self.http.aclose()

    async def _leave(self, instance_id: int, desired: str, reason: str, *, to_idle: bool = False) -> None:
        """Record the new desired state, then stop (a failing write never keeps the backend running)."""
        await self._record_desired(instance_id, desired, reason)
        await self.stop_instance(instance_id, reason, to_idle=to_idle)

    async def _record_desired(self, instance_id: int, desired: str, reason: str) -> None:
        try:
            await _db(lambda: ModelInstance.objects.filter(pk=instance_id).update(
                desired_state=desired, state_message=reason[:500]))()
        except Exception:
            log.warning("could not record desired %s of instance %s", desired, instance_id, exc_info=True)

    async def _settled(self, run: BackendRun) -> None:
        deadline = time.monotonic() + (run.adapter.load_timeout_s() if run.adapter else 60) + 30
        while time.monotonic() < deadline and run.lifecycle and not run.lifecycle.done():
            inst = await db_get(run.instance_id)
            if inst is None or inst.state in (InstanceState.READY, InstanceState.ERROR, InstanceState.STOPPED):
                return
            await asyncio.sleep(0.2)

    # ------------------------------------------------------------ reconcile
    async def reconcile(self) -> None:
        """Make this node's processes match the desired state in the database."""
        instances = await _db(instances_for_node)(self.agent.name)
        seen = set()
        for inst in instances:
            seen.add(inst.pk)
            run = self.runs.get(inst.pk)
            if run is not None and run.stopper is not None:
                if not run.stopper.done():
                    continue  # being stopped
                self._stopper_failed(inst.pk, run)  # it ended with the backend still here: try again below
            if inst.desired_state == DesiredState.STOPPED:
                if run is not None and inst.drain_until is not None and inst.drain_until > timezone.now():
                    run.stopper = asyncio.create_task(self._drain_and_stop(run, inst.drain_until))
                elif run is not None:
                    run.stopper = asyncio.create_task(self.stop_instance(inst.pk, "unload requested"))
                elif inst.state in ACTIVE_STATES:
                    await self._record(inst.pk, ModelInstance.mark_stopped, "unloaded")
                continue
            if inst.desired_state == DesiredState.IDLE:  # idle unload or eviction: stopped, back to IDLE
                reason = inst.state_message if inst.state == InstanceState.READY else "back to idle"
                if run is not None:
                    run.stopper = asyncio.create_task(self.stop_instance(inst.pk, reason, to_idle=True))
                elif inst.state in (*ACTIVE_STATES, InstanceState.ERROR):
                    await self._record(inst.pk, ModelInstance.mark_idle, reason)
                continue
            if run is not None and self._idle_too_long(inst):
                reason = (f"idle unload: no request for {inst.idle_ttl_s} s (idle_ttl_s); "
                          "back to IDLE, the next request starts it")
                await self._record_desired(inst.pk, DesiredState.IDLE, reason)
                run.stopper = asyncio.create_task(self.stop_instance(inst.pk, reason, to_idle=True))
                continue
            if run is not None and inst.restart_requested:
                run.stopper = asyncio.create_task(self._restart(inst.pk))
                continue
            if run is None and inst.state != InstanceState.ERROR:
                if inst.restart_requested:
                    await _db(lambda pk=inst.pk: ModelInstance.objects.filter(pk=pk).update(restart_requested=False))()
                self._launch(inst)
        for pk in [pk for pk in self.runs if pk not in seen]:  # row deleted under a running backend
            run = self.runs[pk]
            if run.stopper is None:
                run.stopper = asyncio.create_task(self.stop_instance(pk, "instance deleted"))

    def _stopper_failed(self, instance_id: int, run: BackendRun) -> None:
        """A stop that ended without taking its run out of `runs` (it raised: a database call failed
        mid-stop, most often) would leave the row UNLOADING for good, since a run with a stopper is
        skipped: the error is logged and the run is handled afresh by this reconcile."""
        task, run.stopper, run.stopping = run.stopper, None, False
        exc = None if task is None or task.cancelled() else task.exception()
        log.warning("stopping instance %s ended without stopping it (%s); trying again", instance_id,
                    f"{exc.__class__.__name__}: {exc}" if exc else "cancelled", exc_info=exc)

    @staticmethod
    def _idle_too_long(inst: ModelInstance) -> bool:
        at = inst.idle_unload_at
        return at is not None and timezone.now() >= at

    async def _restart(self, instance_id: int) -> None:
        await _db(lambda: ModelInstance.objects.filter(pk=instance_id).update(restart_requested=False))()
        inst = await db_get(instance_id)
        run = self.runs.get(instance_id)
        reason = "restart requested"
        if inst is not None and run is not None and inst.drain_until is not None and inst.drain_until > timezone.now():
            # A rolling restart (issue 30 #4): out of routing already, its requests finish first.
            waited, left = await self._drained(run, inst.drain_until, while_desired=DesiredState.RUNNING)
            reason = f"rolling restart: drained in {waited:.1f} s{left}"
        await self.stop_instance(instance_id, reason, keep_desired=True)
        inst = await db_get(instance_id)
        if inst is not None and inst.desired_state == DesiredState.RUNNING and not self.closing:
            inst = await db_mark(instance_id, ModelInstance.mark_pending, "restarting", restarts=0)
            self._launch(inst)

    def _launch(self, inst: ModelInstance, run: BackendRun | None = None) -> BackendRun | None:
        if self.closing:
            return None
        run = run or BackendRun(instance_id=inst.pk)
        self.runs[inst.pk] = run
        run.lifecycle = asyncio.create_task(self._lifecycle(run), name=f"backend-{inst.pk}")
        return run

    # ------------------------------------------------------------ lifecycle
    async def _lifecycle(self, run: BackendRun) -> None:
        try:
            outcome = await (self._watch_ready(run) if run.adopted else self._run_stored(run))
            if outcome == LOAD_FAILED and not run.stopping and await self._fall_back(run):
                outcome = await self._run_stored(run)
            while outcome == CRASHED and not run.stopping:
                inst = await db_get(run.instance_id)
                if inst is None or inst.desired_state != DesiredState.RUNNING:
                    return
                if inst.restarts >= settings.RESTART_LIMIT:
                    await db_mark(run.instance_id, ModelInstance.mark_error,
                                  f"gave up after {inst.restarts} restarts; last error: {inst.last_error[:300]}")
                    return
                delay = settings.RESTART_BACKOFF_S * (2 ** inst.restarts)
                await db_mark(run.instance_id, ModelInstance.mark_error,
                              f"{inst.state_message[:300]}; restarting in {delay} s", event=False)
                await asyncio.sleep(delay)
                if run.stopping:
                    return
                await db_mark(run.instance_id, ModelInstance.mark_pending,
                              f"restart {inst.restarts + 1} of {settings.RESTART_LIMIT} after a crash",
                              restarts=inst.restarts + 1)
                run.adopted = False
                outcome = await self._run_stored(run)
        except asyncio.CancelledError:
            raise
        except IllegalTransition as exc:  # the row moved under us (an unload, most often): nothing may run
            log.info("instance %s changed while starting (%s); stopping its backend", run.instance_id, exc)
            await self._kill(run)
        except Exception as exc:
            log.exception("backend lifecycle of instance %s failed", run.instance_id)
            with contextlib.suppress(Exception):
                await self._kill(run)
            await self._record(run.instance_id, ModelInstance.mark_error, f"supervisor error: {exc}",
                               last_error=str(exc))
        finally:
            if not run.stopping and self.runs.get(run.instance_id) is run:
                await self._stop_tailer(run)
                if run.exited():
                    self.runs.pop(run.instance_id, None)

    async def _run_stored(self, run: BackendRun) -> str:
        """_run_once, tried again with backoff while the store cannot be reached (issue 35 #8): an
        outage of the store is transient, so the instance waits in ERROR saying when it tries next,
        with no retry limit (an unload or a restart ends the wait)."""
        outcome = await self._run_once(run)
        retries = 0
        while outcome == STORE_DOWN and not run.stopping:
            delay = store_retry_delay(retries)
            message = f"{run.store_down[:400]}; store unreachable, retrying in {delay:g} s"
            await db_mark(run.instance_id, ModelInstance.mark_error, message, last_error=message)
            await asyncio.sleep(delay)
            inst = await db_get(run.instance_id)
            if run.stopping or inst is None or inst.desired_state != DesiredState.RUNNING:
                return STOPPED
            retries += 1
            await db_mark(run.instance_id, ModelInstance.mark_pending,
                          f"store try {retries + 1}: copying {run.plan.model_path if run.plan else 'the model'} again")
            outcome = await self._run_once(run)
        return outcome

    async def _run_once(self, run: BackendRun) -> str:
        """Start the backend from the instance's plan and bring it to READY, then watch it."""
        # One trip to the database for the row, the ports taken and the instances on their way out.
        inst, taken, leaving = await _db(_launch_facts)(run.instance_id, self.agent.name)
        if inst is None:
            return STOPPED
        if inst.state != InstanceState.PENDING:  # e.g. STOPPED by the last agent's shutdown, to run again
            if InstanceState.PENDING not in TRANSITIONS[inst.state]:
                await db_mark(inst.pk, ModelInstance.mark_stopped, "no backend runs for it here", keep_gpus=True)
            inst = await _db(start_again)(inst.pk, "starting it again on this node")  # the fit checked, as any start
            if inst is None:  # it does not fit now (its timeline says why): it stays STOPPED
                return STOPPED
            taken, leaving = None, None  # read again where they are needed
        try:
            plan = run.plan = stored_plan(inst) or await _db(plan_for_instance)(inst)
            run.adapter, run.host = get_adapter(plan.backend), plan.host
            model_file = await self._resolve_model(run, plan)
            adapter_files = await self._resolve_adapters(run, plan, model_file) if plan.adapters else {}
            await self._wait_for_build(run, plan)
            port = run.picked_port = await self._pick_port(inst, taken)
            # A new secret per launch: the backend answers no one who does not send it.
            secret, key_file = secrets.token_urlsafe(32), backend_key_file(inst.pk)
            argv = plan.command(port=port, model=model_file, python=sys.executable, key_file=key_file,
                                adapters=adapter_files)
            if KEY_FILE_SLOT not in plan.argv:  # a plan stored before backends had secrets
                argv += run.adapter.key_argv(str(key_file))
            env = backend_environment({**plan.env, **run.adapter.key_env(secret)}, os.environ)
            if str(key_file) in argv:
                await asyncio.to_thread(write_key_file, key_file, secret)
        except StoreDown as exc:
            run.store_down = str(exc)  # _run_stored records it with the time of the next try
            return STORE_DOWN
        except (LoadFailed, LoadRefused) as exc:
            message = exc.message if isinstance(exc, LoadRefused) else str(exc)
            await db_mark(run.instance_id, ModelInstance.mark_error, message, last_error=message)
            return LOAD_FAILED
        except (asyncio.CancelledError, IllegalTransition):
            raise
        except Exception as exc:  # a bad row (e.g. an unknown backend) is an ERROR, not a crash loop
            await db_mark(run.instance_id, ModelInstance.mark_error, f"cannot start: {exc}", last_error=str(exc))
            return LOAD_FAILED
        run.port, run.secret = port, secret
        try:
            await self._wait_for_evictions(run.instance_id, leaving)
            log_path = current_log(run.instance_id)
            run.process = await spawn_backend(argv, env=env, log_path=log_path,
                                              previous_log=previous_log(run.instance_id))
            run.adopted = False
            await db_mark(run.instance_id, ModelInstance.mark_loading, pid=run.process.pid, pgid=run.process.pgid,
                          port=port, gpus=list(plan.gpus), message=f"starting {plan.backend} on port {port}",
                          backend_key=secret)
            self._start_tailer(run, log_path, from_start=True)
            verdict = await self._wait_healthy(run, run.adapter.load_timeout_s())
        finally:  # read at its start (or never: a failed spawn, an unload meanwhile); the row keeps the secret
            key_file.unlink(missing_ok=True)
        if verdict != "ok":
            return await self._failed_load(run, verdict)
        await db_mark(run.instance_id, ModelInstance.mark_warming)
        warm_error = await self._warm_up(run)
        if warm_error:
            return await self._failed_load(run, warm_error)
        await db_mark(run.instance_id, ModelInstance.mark_ready, f"ready on port {port}")
        await self._measure(run)
        return await self._watch_ready(run)

    async def _measure(self, run: BackendRun) -> None:
        """Record what the READY backend holds (its group's GPU memory, or resident memory on the
        CPU) on the instance and for the next load of the same shape (issue 12 #4)."""
        try:
            measured = await asyncio.to_thread(measure_group, run.process.pgid, list(run.plan.gpus))
            if measured is None:
                return
            run.pids = measured.pids
            inst = await db_get(run.instance_id)
            await _db(record_measurement)(run.instance_id, plan=run.plan, extra_args=inst.extra_args if inst else {},
                                          measured_mib=measured.total_mib, source=measured.source,
                                          node_name=self.agent.name)
            log.info("instance %s holds %s", run.instance_id, measured.label)
        except Exception:  # a measurement must never take a READY backend down
            log.warning("measuring instance %s failed", run.instance_id, exc_info=True)

    async def _wait_for_evictions(self, instance_id: int, leaving: int | None) -> None:
        """Instances of this node on their way out (evicted to make room, unloaded) free their
        memory before a new backend takes it. `leaving`: their count read with the row at the
        start (0: none, no query; a start's own evictions are marked before the agent hears of it)."""
        if leaving == 0:
            return
        deadline = time.monotonic() + settings.STOP_GRACE_S + 10
        while time.monotonic() < deadline and await _db(_leaving)(self.agent.name, instance_id):
            await asyncio.sleep(0.1)

    async def _resolve_model(self, run: BackendRun, plan: LaunchPlan) -> Path:
        """The local file or directory to serve: a store prefix is synced into the node cache first
        (a copy that stops when the run does, leaving no *.part behind)."""
        if plan.model_path.startswith("/"):  # checked again here, on this disk, right before the spawn
            try:
                return (await asyncio.to_thread(check_load_path_or_refuse, plan.model_path)).serve
            except LoadRefused as exc:
                raise LoadFailed(f"{exc.message} (checked on node {self.agent.name})") from None
        await db_mark(run.instance_id, ModelInstance.mark_caching, 0.0)
        loop = asyncio.get_running_loop()
        last = {"at": 0.0}

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last["at"] < PROGRESS_EVERY_S and done < total:
                return
            last["at"] = now
            with contextlib.suppress(RuntimeError):  # the loop is closing: the tick does not matter
                asyncio.run_coroutine_threadsafe(db_progress(run.instance_id, 100.0 * done / total if total else 100.0),
                                                 loop)

        local = await self._copy_from_store(run, plan.model_path, progress)
        return Path(resolve_model_path(local, plan.format))

    async def _copy_from_store(self, run: BackendRun, prefix: str, progress=None) -> Path:
        """`prefix` synced into this node's cache: a copy that stops when the run does, leaving no
        *.part behind; StoreDown when the store cannot be reached, LoadFailed for the rest."""
        loop = asyncio.get_running_loop()
        cancel = run.cancel_copy = threading.Event()
        copy = loop.run_in_executor(None, functools.partial(
            sync_to_cache, prefix, node_name=self.agent.name, progress=progress, cancel=cancel))
        try:
            return Path(await asyncio.shield(copy))
        except asyncio.CancelledError:
            cancel.set()  # the copy stops at its next chunk and removes its partial files
            with contextlib.suppress(Exception):
                await copy
            raise
        except Exception as exc:
            kind = StoreDown if isinstance(exc, StoreUnreachable) else LoadFailed
            raise kind(f"copying {prefix} from the store failed: {exc}") from exc
        finally:
            run.cancel_copy = None

    async def _resolve_adapters(self, run: BackendRun, plan: LaunchPlan, model_file: Path) -> dict[str, str]:
        """The LoRA adapters' files on this node (issue 27 #1): one from the store is copied into
        the cache as the model is (an air-gapped node needs only the store); each GGUF adapter is
        checked against the base's architecture here, where both are on one disk (llama.cpp would
        refuse it with a log line only). name -> the path the engine loads, for the argv's slots."""
        local: dict[str, str] = {}
        for adapter in plan.adapters:
            name, path = str(adapter.get("name", "")), str(adapter.get("path", ""))
            if is_stored(adapter):
                folder = await self._copy_from_store(run, path)
                found = layout.lora_to_serve(folder)
                if found is None:
                    raise LoadFailed(f"adapter {name!r}: {path} on node {self.agent.name} holds no GGUF adapter and "
                                     f"no {layout.PEFT_CONFIG}")
                if plan.format == layout.GGUF and ("," in str(found) or ":" in str(found)):
                    raise LoadFailed(f"adapter {name!r}: its file {found.name!r} has ',' or ':', which llama-server's "
                                     "--lora-scaled list cannot hold; upload it under another file name")
                local[name] = str(found)
            else:  # an absolute path: checked again on this disk, as a model's path is
                try:
                    if plan.format == layout.GGUF:
                        await asyncio.to_thread(check_load_path_or_refuse, path)
                    else:
                        await asyncio.to_thread(check_peft_folder, path, name)
                except (LoadRefused, AdapterRefused) as exc:
                    raise LoadFailed(f"adapter {name!r}: {exc.message} (checked on node {self.agent.name})") from None
            if plan.format == layout.GGUF:
                try:
                    await asyncio.to_thread(check_gguf_adapter, local.get(name, path), base=model_file)
                except AdapterRefused as exc:
                    raise LoadFailed(f"{exc.message} (checked on node {self.agent.name})") from None
        return local

    async def _wait_for_build(self, run: BackendRun, plan: LaunchPlan) -> None:
        """A llama.cpp engine whose build still runs on this node (`deploy/bootstrap.sh run` serves
        while it compiles): the start waits in PENDING, its message and progress the build's, and
        goes on by itself once it is built; a failed build fails the load with the build's error.
        An unload meanwhile cancels the wait (stop_instance)."""
        state = waiting_build(plan.backend, plan.executable)  # a few stat() calls: no thread hop on every start
        if state is None:
            return
        shown = ""
        while state is not None and state.state == "building":
            message = f"waiting for the build: {state.label}; {plan.backend} starts when it is built"
            if not shown:
                inst = await db_get(run.instance_id)
                if inst is not None and inst.state == InstanceState.CACHING:
                    await db_mark(run.instance_id, ModelInstance.mark_pending, message)
                elif inst is not None:
                    await _db(inst.note)(message)
            if message != shown:
                await _db(_waiting)(run.instance_id, message, state.percent)
                shown = message
            await asyncio.sleep(BUILD_POLL_S)
            state = await asyncio.to_thread(waiting_build, plan.backend, plan.executable)
        if state is not None:
            raise LoadFailed(f"{plan.backend} cannot start: {state.label}")
        await asyncio.to_thread(export_llama_cpp_lib_path)  # llama-cpp-python's libllama is the build's
        log.info("instance %s: the llama.cpp build it waited for is done", run.instance_id)

    async def _pick_port(self, inst: ModelInstance, taken: set[int] | None = None) -> int:
        # Ports of every node on this address count: several agents may share one host.
        taken = set(taken) if taken is not None else await _db(_ports_taken)(inst)
        # Replicas launched together (issue 30): a port picked by another launch that has not yet spawned.
        taken |= {p for pk, r in self.runs.items() if pk != inst.pk for p in (r.port, r.picked_port) if p}
        try:
            return pick_port(taken=taken, prefer=inst.port, spread_by=self.agent.name)
        except PlacementError as exc:
            raise LoadFailed(str(exc)) from None

    async def _failed_load(self, run: BackendRun, verdict: str) -> str:
        if run.exited():
            await asyncio.sleep(TAIL_POLL_S * 3)  # let the tailer catch the last lines
            message = f"{run.adapter.label} {describe_exit(run.process.returncode)} while loading"
        else:
            message = verdict
            await self._kill(run)
        code = run.process.returncode
        await self._stop_tailer(run)
        last = run.last_lines(1).strip()
        run.did_not_come_up = f"{message}: {last[:300]}" if last else message
        await db_mark(run.instance_id, ModelInstance.mark_error, message,
                      last_error=f"{message}\n{run.last_lines()}".strip(), exit_code=code, log_tail=run.tail)
        return LOAD_FAILED

    async def _fall_back(self, run: BackendRun) -> bool:
        """After a backend did not come up: move the instance to the node's next backend that can
        serve it, once, when its plan allows (issue 12 #3); True when there is one to start."""
        why, run.did_not_come_up = run.did_not_come_up, ""
        if not why or run.plan is None or not run.plan.fallback:
            return False
        inst = await db_get(run.instance_id)
        if inst is None or inst.desired_state != DesiredState.RUNNING:
            return False
        plan, why_not = await _db(fallback_plan)(inst, run.plan)
        if plan is None:
            log.info("instance %s: no fallback after %s (%s)", run.instance_id, run.plan.backend, why_not)
            return False
        await db_mark(run.instance_id, ModelInstance.mark_pending, f"{why}; trying {plan.backend}",
                      backend=plan.backend, backend_reason=plan.reason, plan=plan.to_json(), gpus=list(plan.gpus))
        run.plan, run.adopted = plan, False
        return True

    async def _watch_ready(self, run: BackendRun) -> str:
        code = await run.process.wait()
        if run.stopping:
            return STOPPED
        await asyncio.sleep(TAIL_POLL_S * 3)
        await self._stop_tailer(run)
        run.process.kill_rest()  # nothing of the dead backend's group may linger
        message = f"{run.adapter.label if run.adapter else 'backend'} {describe_exit(code)} while READY"
        await db_mark(run.instance_id, ModelInstance.mark_error, message,
                      last_error=f"{message}\n{run.last_lines()}".strip(), exit_code=code, log_tail=run.tail)
        return CRASHED

    async def _wait_healthy(self, run: BackendRun, timeout: float) -> str:
        """'ok' once the backend's own health answers; else why not (exited / timed out)."""
        run.answered = False  # this process's port, not a crashed one's before it
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            if run.exited():
                return "exited"
            elapsed = time.monotonic() - started
            if (run.answered or elapsed >= STARTING_FAST_FOR_S or await port_listens(run.host, run.port)) \
                    and await self._healthy(run, timeout=2.0):
                return "ok"
            # A ready line in the log only makes the next poll come sooner.
            hint = run.tailer.ready_hint
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(health_poll_s(time.monotonic() - started, answering=run.answered)):
                    await hint.wait()
            hint.clear()
        return f"{run.adapter.label} did not answer {run.adapter.health_path} within {timeout:g} s"

    async def _healthy(self, run: BackendRun, *, timeout: float) -> bool:
        """The one health probe: the backend's own health route answers 200, and the port's listener
        is of the backend's process group (not another process that took the port)."""
        try:
            r = await self.http.get(f"http://{url_host(run.host)}:{run.port}{run.adapter.health_path}",
                                    timeout=timeout, headers=run.headers)
        except httpx.HTTPError:
            return False
        run.answered = True
        return r.status_code == 200 and await asyncio.to_thread(listener_is_ours, run.process.pgid, run.port)

    async def _warm_up(self, run: BackendRun) -> str | None:
        path, body = run.adapter.warmup_request(run.plan)
        try:
            r = await self.http.post(f"http://{url_host(run.host)}:{run.port}{path}", json=body,
                                     timeout=WARMUP_TIMEOUT_S, headers=run.headers)
        except httpx.HTTPError as exc:
            return f"the warm-up request to {path} failed: {exc.__class__.__name__}"
        if r.status_code != 200:
            return f"the warm-up request to {path} answered {r.status_code}: {r.text[:200]}"
        return None

    # ------------------------------------------------------------ log tailing
    def _start_tailer(self, run: BackendRun, path: Path, *, from_start: bool) -> None:
        instance_id = run.instance_id

        async def on_lines(lines: list[str], offset: int) -> None:
            await events.log_lines(instance_id, lines, offset)

        async def on_flush(lines: list[str]) -> None:
            await db_save_tail(instance_id, lines)

        run.tailer = LogTailer(path, hints=run.adapter.ready_hints if run.adapter else (),
                               on_lines=on_lines, on_flush=on_flush)
        run.tailer.start(from_start=from_start)

    async def _stop_tailer(self, run: BackendRun) -> None:
        if run.tailer is not None:
            await run.tailer.stop()

    # ------------------------------------------------------------ stopping
    async def _kill(self, run: BackendRun) -> None:
        """SIGTERM the process group, wait STOP_GRACE_S, SIGKILL the group, reap."""
        if run.process is not None:
            await run.process.stop(settings.STOP_GRACE_S)

    async def _record(self, instance_id: int, mark, *args, **kwargs) -> None:
        """A state change that must not stop what follows: a move the row no longer allows (it got
        there already) is skipped, a failing database is logged (the next agent start reconciles)."""
        try:
            await db_mark(instance_id, mark, *args, **kwargs)
        except (IllegalTransition, ModelInstance.DoesNotExist):
            pass
        except Exception:
            log.warning("could not record %s of instance %s; the next agent start reconciles it",
                        getattr(mark, "__name__", mark), instance_id, exc_info=True)

    async def stop_instance(self, instance_id: int, reason: str, *, keep_desired: bool = False,
                            to_idle: bool = False) -> None:
        """Stop the backend of an instance: kill its group and reap it from what this agent knows,
        while UNLOADING is recorded; then STOPPED, with the port (and the GPUs unless
        `keep_desired`) freed. The kill never waits on the database."""
        run = self.runs.get(instance_id)
        if run is None:
            return
        run.stopping = True
        unloading = asyncio.create_task(self._record(instance_id, ModelInstance.mark_unloading, reason))
        if run.cancel_copy is not None:
            run.cancel_copy.set()
        if run.lifecycle is not None and not run.lifecycle.done():
            await cancel_and_wait(run.lifecycle)  # cancelled again if it lost the cancel (live.tasks)
        pids = sorted(set(run.pids) | set(await asyncio.to_thread(group_pids, run.process.pgid)
                                          if run.process is not None else set()))
        await self._kill(run)
        await self._stop_tailer(run)
        self.runs.pop(instance_id, None)
        await unloading
        await self._check_left_behind(instance_id, run, pids)
        exit_code = run.process.returncode if run.process else None
        if to_idle:
            await self._record(instance_id, ModelInstance.mark_idle, reason, exit_code=exit_code)
        else:
            await self._record(instance_id, ModelInstance.mark_stopped, reason, keep_gpus=keep_desired,
                               exit_code=exit_code)

    async def _check_left_behind(self, instance_id: int, run: BackendRun, pids: list[int]) -> None:
        """After a stop: no process of the group may live on, and none of its pids may still hold
        GPU memory (a "GPU leak": killed, and said in the timeline)."""
        if not pids:
            return
        try:
            by_pid, source = ({}, "")
            if run.plan is not None and run.plan.gpus:
                by_pid, source = await asyncio.to_thread(gpu_memory_by_pid)
            leaks = gpu_leaks(pids, by_pid) if source else {}
            alive = [p for p in pids if pid_alive(p)]
            if not leaks and not alive:
                return
            for pid in sorted(set(alive) | set(leaks)):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            inst = await db_get(instance_id)
            if inst is None:
                return
            for pid, held in leaks.items():
                where = ", ".join(f"{mib} MiB on GPU {gpu}" for gpu, mib in sorted(held.items()))
                await _db(inst.note)(f"GPU leak: pid {pid} of the stopped backend still held {where} ({source}); killed")
            rest = [p for p in alive if p not in leaks]
            if rest:
                await _db(inst.note)(f"processes of the stopped backend were still running ({rest}); killed")
        except Exception:
            log.warning("checking what instance %s left behind failed", instance_id, exc_info=True)

    # ------------------------------------------------------------ agent restart
    def _recorded(self) -> list[ModelInstance]:
        return list(ModelInstance.objects.select_related("node").filter(node__name=self.agent.name, pid__isnull=False))

    def _interrupted(self) -> list[ModelInstance]:
        return list(ModelInstance.objects.select_related("node").filter(
            node__name=self.agent.name, pid__isnull=True, desired_state=DesiredState.RUNNING,
            state__in=(InstanceState.CACHING, InstanceState.LOADING, InstanceState.WARMING)))

    async def adopt_or_stop_orphans(self) -> None:
        """Backends a previous agent started: adopt the healthy ones, stop the rest. Loads it left
        half done with no process (a copy into the cache) go back to PENDING, saying why."""
        for inst in await _db(self._interrupted)():
            await db_mark(inst.pk, ModelInstance.mark_pending,
                          f"the node agent restarted while {inst.state}; starting the load again")
        for inst in await _db(self._recorded)():
            pid, pgid = inst.pid, inst.pgid or inst.pid
            cmd = proc_cmdline(pid) if pid_alive(pid) else []
            ours = bool(cmd) and inst.model_name in cmd and str(inst.port) in cmd
            if not ours:
                if inst.state in ACTIVE_STATES:
                    await db_mark(inst.pk, ModelInstance.mark_stopped, "backend gone after an agent restart",
                                  keep_gpus=True)
                else:
                    await _db(inst.forget_process)()
                continue
            plan = stored_plan(inst)
            adapter = get_adapter(plan.backend if plan else inst.backend)
            run = BackendRun(instance_id=inst.pk, adapter=adapter, plan=plan, port=inst.port,
                             host=plan.host if plan else bind_host(inst.node.address),
                             process=BackendProcess(pid=pid, pgid=pgid), adopted=True, secret=inst.backend_key)
            if inst.state == InstanceState.READY and await self._healthy(run, timeout=3.0):
                self.runs[inst.pk] = run
                self._start_tailer(run, current_log(inst.pk), from_start=False)
                await db_mark(inst.pk, ModelInstance.mark_ready, f"adopted after an agent restart (pid {pid})",
                              adopted=True)
                self._launch(inst, run)
                log.info("adopted backend pid %s of %s", pid, inst)
            else:
                await self._kill(run)
                await db_mark(inst.pk, ModelInstance.mark_stopped,
                              f"stopped a backend the previous agent left {inst.state} (pid {pid})", keep_gpus=True)
