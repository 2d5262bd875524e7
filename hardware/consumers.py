"""Websocket consumers for the hardware pages."""
from __future__ import annotations

from hardware.events import GPUS_GROUP
from live.consumers import LiveConsumer


class GpusConsumer(LiveConsumer):
    """The GPUs page: node cards refreshed whenever an agent's inventory changes."""

    def groups_for(self) -> list[str]:
        return [GPUS_GROUP]
