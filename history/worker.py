"""The node agent's downsampling job (duck-typed agent worker: history sits below serving)."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from history.samples import downsample
from live.db import run_db

log = logging.getLogger("xgen.history")


class DownsampleWorker:
    """Every EVERY_S: roll finished 10 s and 5 min windows up, prune past each retention."""

    name = "history-downsample"
    EVERY_S = 60.0

    async def start(self, agent: Any) -> None:
        return None

    async def run(self, agent: Any) -> None:
        while True:
            try:
                done = await run_db(downsample)
                if done["pruned"]:
                    log.info("history: %d windows rolled up, %d old samples pruned", done["rolled"], done["pruned"])
            except Exception as exc:  # another agent rolled the same window, or the database is away
                log.warning("downsampling the history failed (next try in %.0f s): %s", self.EVERY_S, exc)
            await asyncio.sleep(self.EVERY_S)

    async def stop(self, agent: Any) -> None:
        return None
