"""live.tasks.cancel_and_wait ends a task that lost its cancellation. In CI a backend's log tailer
went on polling after its stop had cancelled it once, and the node agent's SIGTERM stop waited on it
until its deadline (tests/cluster/test_cross_node, the loop's task dump in the agent's log)."""
from __future__ import annotations

import asyncio
import contextlib

from live.tasks import cancel_and_wait


async def _loses_one_cancel(ticks: list[int]) -> None:
    """A loop whose call swallows the first cancellation (as a callee that catches CancelledError
    and returns would), then goes on."""
    swallowed = False
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True
            asyncio.current_task().uncancel()
        ticks.append(1)


async def test_a_task_that_loses_its_cancellation_is_cancelled_again_until_it_ends():
    ticks: list[int] = []
    task = asyncio.create_task(_loses_one_cancel(ticks))
    await asyncio.sleep(0.05)
    task.cancel()  # what the stop did before: one cancel, then a wait with no end
    done, _ = await asyncio.wait({task}, timeout=0.3)
    assert not done and len(ticks) > 5  # it lost the cancel and polls on
    await asyncio.wait_for(cancel_and_wait(task, again_s=0.1), timeout=5)
    assert task.cancelled()


async def test_a_task_that_ends_with_an_error_or_is_done_already_is_waited_for_quietly():
    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("boom")

    failing = asyncio.create_task(fails())
    with contextlib.suppress(RuntimeError):
        await asyncio.shield(failing)
    await cancel_and_wait(failing)  # done already: nothing raised, its error retrieved
    await cancel_and_wait(None)
    sleeping = asyncio.create_task(asyncio.sleep(60))
    await cancel_and_wait(sleeping)
    assert sleeping.cancelled()
