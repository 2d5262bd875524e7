"""The node agent: one per node. Registers the node, heartbeats, and (as later parts land)
detects hardware, runs downloads and cache syncs, and supervises backend processes.

It runs in `manage.py nodeagent` or inside `manage.py serve` (same event loop as the web
server). Database work goes through live.db.run_db (the agent outlives database
restarts: every call gets a working connection); nothing here blocks the loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import uuid
from pathlib import Path

from channels.layers import get_channel_layer
from django.conf import settings

from hardware.inventory import InventoryWorker
from hardware.services import (
    LOCAL_AGENT_RUNS,
    NodeHeld,
    NodeTaken,
    host_identity,
    record_heartbeat,
    register_node,
    release_node,
)
from history.worker import DownsampleWorker
from hub.worker import HubWorker
from live.db import DatabaseUnavailable, run_db
from live.tasks import cancel_and_wait
from serving.control.events import node_group
from serving.node.supervisor import Supervisor
from serving.node.workers import AgentWorker, RequestLogPruner, UsageJournalReplayer

log = logging.getLogger("xgen.agent")


HEARTBEAT_RETRY_S = 1.0  # the next try after a heartbeat failed


class AgentAlreadyRunning(RuntimeError):
    """Another agent holds this node's lock."""


# What stops an agent before or during its run because another agent has the node: exit non-zero.
AGENT_REFUSED = (AgentAlreadyRunning, NodeHeld, NodeTaken)


def default_workers() -> list[AgentWorker]:
    """The explicit registry of what a node agent does, in start order (one line per worker)."""
    workers: list[AgentWorker] = []
    workers.append(InventoryWorker())  # hardware: GPUs, CPU/RAM and backends; refreshed live
    workers.append(HubWorker())  # hub: store index, demo model, Hugging Face download jobs
    workers.append(Supervisor())  # serving: backend processes of this node's instances
    workers.append(RequestLogPruner())  # serving: the request log's retention (XGEN_REQUEST_LOG_DAYS)
    workers.append(UsageJournalReplayer())  # serving: usage a killed web process left in its journal
    workers.append(DownsampleWorker())  # history: the dashboard's samples rolled up and pruned
    return workers


class NodeAgent:
    def __init__(
        self, *, name: str | None = None, address: str | None = None, workers: list[AgentWorker] | None = None
    ) -> None:
        self.name = name or settings.NODE_NAME
        self.address = address or settings.NODE_ADDRESS
        self.workers = default_workers() if workers is None else workers
        self._lock_fh = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.started = asyncio.Event()
        # This run's id: the node's inventory is stale until this run saves one. An agent without
        # the hardware worker saves none, so it registers without one (nothing waits for it).
        self.run_id = uuid.uuid4().hex if any(w.name == "hardware" for w in self.workers) else ""
        # This process's claim on the node (every agent has one): no second agent takes a live node.
        self.agent_id = uuid.uuid4().hex
        self.host = host_identity()
        # Set when another agent took the node: stop without touching the node's instances.
        self.displaced: NodeTaken | None = None
        self._lost = asyncio.Event()
        self._registered = False
        self._started_workers: list[AgentWorker] = []

    def acquire_lock(self) -> None:
        """A file lock makes the agent a singleton per node (per data dir)."""
        lock_dir = Path(settings.DATA_DIR)
        lock_dir.mkdir(parents=True, exist_ok=True)
        fh = open(lock_dir / f"agent-{self.name}.lock", "a+")  # noqa: SIM115 (held for the agent's life)
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise AgentAlreadyRunning(f"another node agent for {self.name!r} is running (lock {fh.name})") from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self._lock_fh = fh

    def release_lock(self) -> None:
        if self._lock_fh is not None:
            fcntl.flock(self._lock_fh.fileno(), fcntl.LOCK_UN)
            self._lock_fh.close()
            self._lock_fh = None

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set, then shut down what the agent owns."""
        self.acquire_lock()
        if self.run_id:
            LOCAL_AGENT_RUNS[self.name] = self.run_id  # before it registers: no load reads the last run's inventory
        try:
            # SIGTERM during the start (a pod deleted while autostart models load, a restart that
            # stalls on the store) stops it there: the workers started so far are stopped below.
            starting = asyncio.create_task(self.start(), name="agent-start")
            stopped = asyncio.create_task(stop.wait())
            try:
                await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
            if not starting.done():
                log.info("node agent %s: stopped while starting", self.name)
                await cancel_and_wait(starting)
                return
            starting.result()  # a start that failed (a refused registration) raises here
            self.started.set()
            self._tasks = [
                asyncio.create_task(self._heartbeat_loop(), name="agent-heartbeat"),
                asyncio.create_task(self._nudge_listener(), name="agent-nudges"),
            ] + [asyncio.create_task(self._run_worker(w), name=f"agent-{w.name}") for w in self.workers]
            stopped, lost = asyncio.create_task(stop.wait()), asyncio.create_task(self._lost.wait())
            try:
                await asyncio.wait({stopped, lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
                lost.cancel()
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.shutdown()
            if self._registered and self.displaced is None:
                await self._release()
            if LOCAL_AGENT_RUNS.get(self.name) == self.run_id:
                LOCAL_AGENT_RUNS.pop(self.name, None)
            self.release_lock()
        if self.displaced is not None:
            raise self.displaced

    async def start(self) -> None:
        # Refused (NodeHeld) before any worker starts: a duplicate adopts, stops and writes nothing.
        await run_db(register_node, name=self.name, address=self.address, run=self.run_id,
                     agent_id=self.agent_id, host=self.host)
        self._registered = True
        log.info("node agent %s registered (address %s, pid %s)", self.name, self.address, os.getpid())
        for worker in self.workers:
            self._started_workers.append(worker)
            await worker.start(self)

    async def _release(self) -> None:
        """Free the node for the next agent at once (a restart need not wait for the heartbeat to age)."""
        try:
            async with asyncio.timeout(5):  # a database that is away must not hold the stop
                await run_db(release_node, name=self.name, agent_id=self.agent_id)
        except Exception as exc:
            log.warning("could not free node %s (%s); the next agent takes it once the heartbeat is stale",
                        self.name, exc)

    async def shutdown(self) -> None:
        for worker in reversed(self._started_workers):
            try:
                await worker.stop(self)
            except Exception:
                log.exception("stopping %s failed", worker.name)
        if self._registered:
            log.info("node agent %s stopped", self.name)

    async def _run_worker(self, worker: AgentWorker) -> None:
        """A worker's loop; a crash is logged and the loop restarted, never the agent lost."""
        while True:
            try:
                await worker.run(self)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("agent worker %s crashed; restarting in 1 s", worker.name)
                await asyncio.sleep(1)

    def nudge(self) -> None:
        """Wake whoever waits in wait_for_nudge (the reconcile loop)."""
        self._wake.set()

    async def wait_for_nudge(self, timeout: float) -> bool:
        """Sleep until nudged or `timeout` passes; True when nudged."""
        try:
            async with asyncio.timeout(timeout):  # not wait_for: see live/groups.py
                await self._wake.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self._wake.clear()

    async def _heartbeat_loop(self) -> None:
        delay = settings.HEARTBEAT_INTERVAL_S
        while True:
            await asyncio.sleep(delay)
            # After a failed beat the next try comes within a second, not a whole interval: the
            # first beat once the database is back ends the node's staleness at once (issue 35 #1).
            delay = min(HEARTBEAT_RETRY_S, settings.HEARTBEAT_INTERVAL_S)
            try:
                await run_db(self._heartbeat)
                delay = settings.HEARTBEAT_INTERVAL_S
            except NodeTaken as exc:  # never fight the new holder: stop, leaving the node's rows to it
                log.error("%s", exc)
                self.displaced = exc
                self._lost.set()
                return
            except DatabaseUnavailable as exc:  # a restart: no traceback every second
                log.warning("heartbeat failed, the database is unavailable (%s); retrying in %.0f s", exc, delay)
            except Exception:
                log.exception("heartbeat failed; retrying")

    def _heartbeat(self) -> None:
        # Workers that own backend processes expose them as `runs` (the supervisor).
        running = sum(len(getattr(w, "runs", {})) for w in self.workers)
        record_heartbeat(name=self.name, instances_running=running, agent_id=self.agent_id, host=self.host)

    async def _nudge_listener(self) -> None:
        """Web processes `group_send` to node.<name>; any message wakes the reconcile loop.

        Outlives the channel layer: a receive that fails (Redis down) starts over on a new
        channel a second later, and the group membership is renewed every reconcile interval,
        since a Redis restarted without persistence has forgotten it (and channels-redis drops
        members after its group expiry). A lost nudge only waits for the next reconcile.
        """
        layer = get_channel_layer()
        if layer is None:
            return
        group = node_group(self.name)
        while True:
            channel = None
            renew = None
            try:
                channel = await layer.new_channel()  # the default prefix, as every receiver (xgenconsole.views)
                await layer.group_add(group, channel)
                renew = asyncio.create_task(self._renew_membership(layer, group, channel))
                while True:
                    await layer.receive(channel)
                    self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("nudges: the channel layer failed (%s: %s); listening again in 1 s",
                            exc.__class__.__name__, exc)
            finally:
                if renew is not None:
                    renew.cancel()
                if channel is not None:
                    with contextlib.suppress(Exception):
                        await layer.group_discard(group, channel)
            await asyncio.sleep(1)

    @staticmethod
    async def _renew_membership(layer, group: str, channel: str) -> None:
        while True:
            await asyncio.sleep(settings.RECONCILE_INTERVAL_S)
            try:
                await layer.group_add(group, channel)
            except Exception as exc:  # the receive loop notices a layer that is gone for good
                log.warning("nudges: renewing the %s membership failed: %s", group, exc)
