"""The per-model queue is shared fairly among keys (issue 23, item 3: one key filling the queue
for everyone). ModelGate is the queue itself (serving.proxy.ondemand), driven here on its own
loop; tests/proxy/test_queue.py drives it through a real console."""
from __future__ import annotations

import asyncio

import pytest

from serving.proxy.errors import ProxyError
from serving.proxy.ondemand import ModelGate, queue_owner


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.fixture
def small_queue(settings):
    settings.QUEUE_MAX = 4
    settings.QUEUE_TIMEOUT_S = 30


async def test_a_key_that_fills_the_queue_makes_room_for_another_key(small_queue):
    gate = ModelGate("shared")
    busy = await gate.acquire(1, 4, "key:1")  # the one slot
    flood = [asyncio.create_task(gate.acquire(1, 4, "key:1")) for _ in range(4)]
    await _settle()
    assert gate.waiting == 4 and not any(t.done() for t in flood)
    other = asyncio.create_task(gate.acquire(1, 4, "key:2"))
    await _settle()
    assert not other.done(), "the other key waits in the queue instead of a 429"
    pushed = flood[-1]
    assert pushed.done() and isinstance(pushed.exception(), ProxyError)
    assert pushed.exception().status == 429 and pushed.exception().code == "queue_full"
    assert "this key held 4 of 4" in pushed.exception().message
    assert gate.waiting == 4

    # Round robin within a priority: the other key's first request goes before the flooder's second.
    busy.release()
    await _settle()
    assert flood[0].done() and not other.done()
    flood[0].result().release()
    await _settle()
    assert other.done() and not flood[1].done(), "the other key was served before the flooder's second"
    other.result().release()
    await _settle()
    assert flood[1].done()
    flood[1].result().release()
    await _settle()
    flood[2].result().release()
    assert gate.waiting == 0 and gate.active == 0


async def test_a_queue_shared_fairly_already_refuses_the_next(small_queue):
    gate = ModelGate("fair")
    busy = await gate.acquire(1, 4, "key:1")
    waiters = [asyncio.create_task(gate.acquire(1, 4, f"key:{1 + i % 2}")) for i in range(4)]  # 2 and 2
    await _settle()
    with pytest.raises(ProxyError) as full:
        await gate.acquire(1, 4, "key:1")
    assert full.value.code == "queue_full" and gate.waiting == 4
    third = asyncio.create_task(gate.acquire(1, 4, "key:3"))  # 2, 2 and none: one of 2 gives way
    await _settle()
    assert not third.done() and sum(t.done() for t in waiters) == 1 and gate.waiting == 4
    for task in [*waiters, third]:
        task.cancel()
    await _settle()
    busy.release()
    assert gate.waiting == 0 and gate.active == 0


async def test_priority_still_goes_first(small_queue):
    gate = ModelGate("prio")
    busy = await gate.acquire(1, 4, "key:1")
    low = [asyncio.create_task(gate.acquire(1, 1, "key:1")) for _ in range(2)]
    await _settle()
    high = asyncio.create_task(gate.acquire(1, 7, "key:1"))
    await _settle()
    busy.release()
    await _settle()
    assert high.done() and not any(t.done() for t in low)
    high.result().release()
    await _settle()
    low[0].result().release()
    await _settle()
    low[1].result().release()
    assert gate.active == 0


def test_queue_owner_names_the_key_the_user_or_the_address():
    from accounts.credentials import Principal

    assert queue_owner(Principal(user_id=3, username="u", role="viewer", key_id=9)) == "key:9"
    assert queue_owner(Principal(user_id=3, username="u", role="viewer", key_id=0)) == "user:3"
    assert queue_owner(None, "10.0.0.1") == "addr:10.0.0.1"
