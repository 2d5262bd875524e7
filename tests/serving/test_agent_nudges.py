"""The agent's nudge listener outlives its channel layer: a receive that fails (Redis went
away) is listened to again, and a group membership the layer forgot (Redis restarted without
persistence) is renewed within a reconcile interval."""
from __future__ import annotations

import asyncio
import time

from channels.layers import InMemoryChannelLayer

from serving.control.events import node_group
from serving.node import agent as agent_module
from serving.node.agent import NodeAgent


async def _nudged(agent: NodeAgent, layer, within: float) -> bool:
    """Nudge the node until the agent wakes, for at most `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        await layer.group_send(node_group(agent.name), {"type": "agent.nudge"})
        if await agent.wait_for_nudge(0.1):
            return True
    return False


async def test_nudges_survive_a_failing_layer_and_a_forgotten_group(monkeypatch, settings):
    settings.RECONCILE_INTERVAL_S = 0.2
    layer = InMemoryChannelLayer()
    receive = layer.receive
    failures = [ConnectionError("Connection closed by server.")]

    async def flaky_receive(channel: str) -> dict:
        if failures:
            await asyncio.sleep(0.05)
            raise failures.pop()
        return await receive(channel)

    monkeypatch.setattr(layer, "receive", flaky_receive)
    monkeypatch.setattr(agent_module, "get_channel_layer", lambda: layer)
    agent = NodeAgent(name="nudged", address="127.0.0.1", workers=[])
    listener = asyncio.create_task(agent._nudge_listener())
    try:
        assert await _nudged(agent, layer, within=5), "the listener did not come back after a failed receive"
        assert not failures
        layer.groups.clear()  # what a Redis restart without persistence does
        await asyncio.sleep(0.5)  # more than a reconcile interval
        assert await _nudged(agent, layer, within=0.3), "the group membership was not renewed"
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    assert not layer.groups.get(node_group("nudged"))  # left the group on the way out
