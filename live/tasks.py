"""The one way a process's background loops are stopped at shutdown."""
from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None, *, again_s: float = 2.0) -> None:
    """Cancel `task` (if any) and wait until it has ended; its cancellation and any error it ended
    with are swallowed (shutdown: what it left is flushed by the caller).

    A task can lose a cancellation and go on (one that catches CancelledError in a call it makes
    and carries on; seen in CI: a backend's log tailer went on polling after its stop's cancel, and
    the node agent's stop waited on it until its deadline): it is cancelled again every `again_s`
    until it ends."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=again_s)
    if not task.cancelled():
        task.exception()  # retrieved: never "exception was never retrieved" at exit


__all__ = ["cancel_and_wait"]
