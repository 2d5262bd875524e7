"""The node agent's workers: the shape every part of the agent's work has (AgentWorker), what a
worker sees of the agent (Agent), and serving's own small workers (the request log's retention,
the usage journal's replay). Workers of lower apps (hardware, hub, history) have the same three
methods without importing this (duck typing keeps the layers apart). The usage journal's replay and
pruning are the proxy's usage recording (serving.proxy.usage): the one part of the data plane the
node calls. Nothing here imports the agent: the agent imports its workers, never the other way
round (not even for type checking)."""
from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import Protocol

from django.conf import settings

from hardware.services import NodeTaken
from live.db import run_db
from serving.proxy.usage import prune_journal_segments, replay_journal

log = logging.getLogger("xgen.usage")


class Agent(Protocol):
    """What a worker reads of the node agent that runs it (serving.node.agent.NodeAgent)."""

    name: str
    host: str
    displaced: NodeTaken | None

    async def wait_for_nudge(self, timeout: float) -> bool: ...


class AgentWorker:
    """A part of the agent's work, contributed by one app. Subclasses override what they need.

    start(): once, after the node is registered and before the agent counts as started.
    run(): a long-running loop; cancelled when the agent stops.
    stop(): once, when the agent stops (stop what this worker owns, cleanly).
    """

    name = "worker"

    async def start(self, agent: Agent) -> None:
        return None

    async def run(self, agent: Agent) -> None:
        return None

    async def stop(self, agent: Agent) -> None:
        return None


# ---------------------------------------------------------------- request-log retention
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

    async def run(self, agent: Agent) -> None:
        while True:
            try:
                removed = await run_db(prune_request_log)
                if removed:
                    log.info("request log: %d rows older than %d days pruned", removed, settings.REQUEST_LOG_DAYS)
                await run_db(prune_journal_segments)
            except Exception as exc:
                log.warning("pruning the request log failed (next try in an hour): %s", exc)
            await asyncio.sleep(self.PRUNE_EVERY_S)


class UsageJournalReplayer(AgentWorker):
    """The node agent's part of the usage journal: at its start and every REPLAY_EVERY_S, write
    what web processes that died left in this data dir's journal (a web process also does so at
    its start and at each of its writes; the segments' locks let one replayer take each)."""

    name = "usage-journal"
    REPLAY_EVERY_S = 60.0

    async def start(self, agent: Agent) -> None:
        await self._replay()

    async def run(self, agent: Agent) -> None:
        while True:
            await asyncio.sleep(self.REPLAY_EVERY_S)
            await self._replay()

    @staticmethod
    async def _replay() -> None:
        if not settings.USAGE_JOURNAL:
            return
        try:
            await run_db(replay_journal, settings.USAGE_JOURNAL_DIR)
        except Exception as exc:  # the segments stay for the next try
            log.warning("replaying the usage journal failed: %s", exc)
