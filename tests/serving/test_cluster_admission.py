"""Cluster admission's rule (issue 25 #1) against real Redis on loopback (the Lua script): two
ClusterAdmission objects stand for two web processes sharing one model's slots and queue, each
under a key prefix of its own. The whole thing with real web processes: tests/cluster/."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from serving.proxy.cluster_admission import ClusterAdmission
from serving.proxy.errors import ProxyError

REDIS = "redis://127.0.0.1:6379/13"


@pytest.fixture
async def two() -> AsyncIterator[tuple[ClusterAdmission, ClusterAdmission]]:
    prefix = f"xgen-test-adm:{uuid.uuid4().hex[:8]}"
    a, b = ClusterAdmission(REDIS, prefix=prefix), ClusterAdmission(REDIS, prefix=prefix)
    yield a, b
    await a.close()
    await b.close()


async def started(coro) -> asyncio.Task:
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0.05)  # in the queue by now
    return task


async def test_slots_are_shared_and_a_release_wakes_the_other_processes_head_by_priority(two) -> None:
    a, b = two
    held = [await a.acquire("m", 2, 4), await b.acquire("m", 2, 4)]
    low = await started(b.acquire("m", 2, 1))
    high = await started(a.acquire("m", 2, 9))
    normal = await started(b.acquire("m", 2, 4))
    assert not (low.done() or high.done() or normal.done())
    assert a.waiting("m") == 1 and b.waiting("m") == 2
    b.release(*held[1])  # b gives back: a's high-priority waiter gets it (pub/sub), not b's own
    await asyncio.wait_for(high, 2)
    assert not (low.done() or normal.done())
    a.release(*held[0])
    await asyncio.wait_for(normal, 2)  # then priority 4 before priority 1
    assert not low.done()
    a.release(*high.result())
    await asyncio.wait_for(low, 2)
    b.release(*normal.result())
    b.release(*low.result())


async def test_the_queue_limit_holds_across_processes(two, settings) -> None:
    settings.QUEUE_MAX = 2
    a, b = two
    held = await a.acquire("m", 1, 4)
    waiters = [await started(a.acquire("m", 1, 4)), await started(b.acquire("m", 1, 4))]
    with pytest.raises(ProxyError) as refused:
        await b.acquire("m", 1, 4)
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    for task in waiters:  # a client that leaves leaves the queue
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    await asyncio.sleep(0.05)  # the releases go within RELEASE_COALESCE_S
    a.release(*held)
    again = await asyncio.wait_for(b.acquire("m", 1, 4), 2)
    b.release(*again)


async def test_a_process_that_stops_renewing_loses_its_slots_within_the_lease(two, settings) -> None:
    settings.ADMISSION_LEASE_S = 1
    a, b = two
    await a.acquire("m", 1, 4)
    a._held.clear()  # as if the process died: nothing renews its lease (and nothing gives it back)
    waiter = await started(b.acquire("m", 1, 4))
    got = await asyncio.wait_for(waiter, 3)  # the lease (1 s), then b's renewal tick hands it on
    b.release(*got)


@pytest.mark.django_db
def test_the_dashboard_says_when_admission_fell_back_to_the_process(client, viewer, settings) -> None:
    from serving.proxy import cluster_admission
    from serving.proxy.cluster_admission import AdmissionUnavailable

    client.force_login(viewer.user)
    assert "Redis cannot be reached" not in client.get("/").content.decode()
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there

    async def fail() -> None:
        admission = cluster_admission.cluster_admission()
        assert admission is not None
        with pytest.raises(AdmissionUnavailable):
            await admission.acquire("m", 1, 4)

    try:
        asyncio.run(fail())
        assert "Redis cannot be reached" in client.get("/").content.decode()
    finally:
        asyncio.run(cluster_admission.shutdown_cluster_admission())
    assert "Redis cannot be reached" not in client.get("/").content.decode()


async def test_a_granted_waiter_leaves_the_queue_and_its_depth(two) -> None:
    """A waiter handed a slot stopped counting as waiting: the depth gauge (and what the lease
    renewer renews as waiting) kept every granted waiter, so /metrics showed the queue full after
    it had drained (tests/cluster/test_restart_queue_full.py's second run met a depth of 3)."""
    from serving.proxy import metrics

    a, b = two
    held = await a.acquire("m", 1, 4)
    waiters = [await started(a.acquire("m", 1, 4)), await started(b.acquire("m", 1, 4))]
    assert a.waiting("m") == 1 and b.waiting("m") == 1
    a.release(*held)
    first = await asyncio.wait_for(waiters[0], 2)
    assert a.waiting("m") == 0 and b.waiting("m") == 1
    a.release(*first)
    second = await asyncio.wait_for(waiters[1], 2)
    b.release(*second)
    assert a.waiting("m") == 0 and b.waiting("m") == 0
    assert metrics.QUEUE_DEPTH.labels("m")._value.get() == 0
