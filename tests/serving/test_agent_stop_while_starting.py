"""A node agent told to stop (SIGTERM: a deleted pod, `systemctl stop`) while it is still starting
stops there. Before, `run()` awaited every worker's start before it looked at the stop, so a start
that took long (autostart models loading, a store that does not answer the start's sweep) kept a
SIGTERM waiting: a test cluster's teardown waited 40 s for such an agent and killed it (twice in
the clean-clone run, about 80 s of CI), and Kubernetes would SIGKILL it after its grace period."""
from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async

from serving.node.agent import NodeAgent
from serving.node.workers import AgentWorker

pytestmark = pytest.mark.django_db(transaction=True)


class _SlowStart(AgentWorker):
    """A worker whose start takes as long as a slow load: it returns only when cancelled."""

    name = "slow-start"

    def __init__(self) -> None:
        self.starting = asyncio.Event()
        self.stopped = False

    async def start(self, agent) -> None:
        self.starting.set()
        await asyncio.Event().wait()

    async def stop(self, agent) -> None:
        self.stopped = True


async def test_a_stop_during_the_start_stops_the_agent_at_once_and_frees_its_node():
    from hardware.models import Node

    worker = _SlowStart()
    agent = NodeAgent(name="slow-starter", address="127.0.0.1", workers=[worker])
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run(stop))
    await asyncio.wait_for(worker.starting.wait(), 30)
    stop.set()
    await asyncio.wait_for(running, 10)  # it returns (a liveness bound, not a speed claim); before: never
    assert worker.stopped, "the worker that was starting is stopped like a started one"
    assert not agent.started.is_set()
    node = await sync_to_async(Node.objects.get)(name="slow-starter")
    assert node.agent_id == "", "the node is free for the next agent at once"
