"""Websocket consumers for the hardware pages."""
from __future__ import annotations

from hardware.allocation import visible_instances
from hardware.events import GPUS_GROUP
from live.consumers import LiveConsumer
from live.db import run_db


class GpusConsumer(LiveConsumer):
    """The GPUs page: node cards refreshed whenever an agent's inventory changes. The cards are
    every node's, so a team lead held to its teams' GPUs is refused (4403): its page polls."""

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is not None and user.is_authenticated and await run_db(visible_instances, user) is not None:
            await self.close(code=4403)
            return
        await super().connect()

    def groups_for(self) -> list[str]:
        return [GPUS_GROUP]
