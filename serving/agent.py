"""The node agent: one per node. Registers the node, heartbeats, and (as later parts land)
detects hardware, runs downloads and cache syncs, and supervises backend processes.

It runs in `manage.py nodeagent` or inside `manage.py serve` (same event loop as the web
server). Database work goes through `sync_to_async`; nothing here blocks the loop.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import os
from pathlib import Path

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import close_old_connections

from hardware.services import record_heartbeat, register_node

log = logging.getLogger("xgen.agent")


class AgentAlreadyRunning(RuntimeError):
    """Another agent holds this node's lock."""


def node_group(name: str) -> str:
    """Channel-layer group that nudges the agent of node `name`."""
    return f"node.{name}"


class NodeAgent:
    def __init__(self, *, name: str | None = None, address: str | None = None) -> None:
        self.name = name or settings.NODE_NAME
        self.address = address or settings.NODE_ADDRESS
        self._lock_fh = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.started = asyncio.Event()

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
        try:
            await self.start()
            self.started.set()
            self._tasks = [
                asyncio.create_task(self._heartbeat_loop(), name="agent-heartbeat"),
                asyncio.create_task(self._nudge_listener(), name="agent-nudges"),
            ]
            await stop.wait()
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.shutdown()
            self.release_lock()

    async def start(self) -> None:
        await sync_to_async(register_node)(name=self.name, address=self.address)
        log.info("node agent %s registered (address %s, pid %s)", self.name, self.address, os.getpid())

    async def shutdown(self) -> None:
        log.info("node agent %s stopped", self.name)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(settings.HEARTBEAT_INTERVAL_S)
            try:
                await sync_to_async(self._heartbeat)()
            except Exception:
                log.exception("heartbeat failed; retrying")

    def _heartbeat(self) -> None:
        close_old_connections()
        record_heartbeat(name=self.name)

    async def _nudge_listener(self) -> None:
        """Web processes `group_send` to node.<name>; any message wakes the reconcile loop."""
        layer = get_channel_layer()
        if layer is None:
            return
        channel = await layer.new_channel("agent.")
        await layer.group_add(node_group(self.name), channel)
        try:
            while True:
                await layer.receive(channel)
                self._wake.set()
        finally:
            await layer.group_discard(node_group(self.name), channel)
