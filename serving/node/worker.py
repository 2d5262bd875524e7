"""The shape of a node agent's worker. Workers of lower apps (hardware, hub) have the same three
methods without importing this (duck typing keeps the layers apart)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.node.agent import NodeAgent


class AgentWorker:
    """A part of the agent's work, contributed by one app. Subclasses override what they need.

    start(): once, after the node is registered and before the agent counts as started.
    run(): a long-running loop; cancelled when the agent stops.
    stop(): once, when the agent stops (stop what this worker owns, cleanly).
    """

    name = "worker"

    async def start(self, agent: NodeAgent) -> None:
        return None

    async def run(self, agent: NodeAgent) -> None:
        return None

    async def stop(self, agent: NodeAgent) -> None:
        return None
