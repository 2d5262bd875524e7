"""The one way a process's background loops are stopped at shutdown."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (if any) and wait until it has ended; its cancellation and any error it ended
    with are swallowed (shutdown: what it left is flushed by the caller)."""
    if task is None:
        return
    task.cancel()  # a task already done stays as it is
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


__all__ = ["cancel_and_wait"]
