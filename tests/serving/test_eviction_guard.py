"""A cold start asked for by a request never evicts a model in use (issue 23, item 3): any key,
a viewer's too, may start an idle on_demand model, and a start makes room by evicting unpinned
on_demand models least recently used first; one used or started within XGEN_EVICT_GRACE_S is
another team's model at work, so the request is refused 503 insufficient_capacity instead.
The operator's Start button keeps its power to evict it."""
from __future__ import annotations

import pytest

from serving.control.capacity import NoRoom
from tests.serving.test_capacity import post, ready, row

pytestmark = pytest.mark.django_db


def _two_on_a_node_with_room_for_one(client, node, operator, tiny_gguf, *, used_ago_s: float) -> tuple[int, int]:  # noqa: F811
    type(node).objects.filter(pk=node.pk).update(model_memory_mib=600)  # one tiny model (514 MiB)
    ids = []
    for name in ("busy", "idle"):
        r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": name, "policy": "on_demand"},
                 operator.key)
        assert r.status_code == 202 and r.json()["state"] == "IDLE", r.content
        ids.append(r.json()["id"])
    ready(ids[0], used_ago_s=used_ago_s)
    return ids[0], ids[1]


def test_a_cold_start_does_not_evict_a_model_used_within_the_grace(client, node, operator, tiny_gguf,  # noqa: F811
                                                                   settings):
    from serving.control.services import request_cold_start
    from serving.models import ModelInstance

    settings.EVICT_GRACE_S = 60
    busy, idle = _two_on_a_node_with_room_for_one(client, node, operator, tiny_gguf, used_ago_s=5)
    with pytest.raises(NoRoom) as refused:
        request_cold_start(instance_id=idle)
    assert f"busy (instance {busy}) 514 MiB (in use within 60 s)" in refused.value.message, refused.value.message
    assert refused.value.holders[0].evictable is False
    kept, events = row(busy)
    assert kept.desired_state == "RUNNING" and not any("evicted" in e for e in events)
    assert ModelInstance.objects.get(pk=idle).state == "IDLE"


def test_a_cold_start_evicts_a_model_idle_for_longer_than_the_grace(client, node, operator, tiny_gguf,  # noqa: F811
                                                                    settings):
    from serving.control.services import request_cold_start

    settings.EVICT_GRACE_S = 60
    busy, idle = _two_on_a_node_with_room_for_one(client, node, operator, tiny_gguf, used_ago_s=120)
    assert request_cold_start(instance_id=idle).state == "PENDING"
    evicted, events = row(busy)
    assert evicted.desired_state == "IDLE" and "evicted to make room for idle (514 MiB needed)" in events


def test_the_start_button_may_still_evict_a_model_in_use(client, node, operator, tiny_gguf, settings):  # noqa: F811
    settings.EVICT_GRACE_S = 60
    busy, idle = _two_on_a_node_with_room_for_one(client, node, operator, tiny_gguf, used_ago_s=5)
    r = post(client, "start", {"id": idle}, operator.key)
    assert r.status_code == 202, r.content
    evicted, events = row(busy)
    assert evicted.desired_state == "IDLE" and "evicted to make room for idle (514 MiB needed)" in events


@pytest.mark.django_db(transaction=True)  # the proxy reads the key and the rows from its own threads
def test_a_viewers_request_gets_503_insufficient_capacity_and_the_model_in_use_stays(
        node, operator, viewer, tiny_gguf, settings):  # noqa: F811
    """Through the proxy core (the Ninja mirror of /v1/chat/completions), as a viewer's key."""
    import asyncio

    from django.test import AsyncClient, Client

    from serving.proxy.replicas import routing_table
    from serving.proxy.upstream import shutdown_proxy

    settings.EVICT_GRACE_S = 60
    busy, idle = _two_on_a_node_with_room_for_one(Client(), node, operator, tiny_gguf, used_ago_s=5)
    routing_table.invalidate()

    async def ask():
        try:
            return await AsyncClient().post(
                "/api/inference/v1/chat/completions", {"model": "idle", "messages": [{"role": "user", "content": "x"}]},
                content_type="application/json", headers={"authorization": f"Bearer {viewer.key}"})
        finally:
            await shutdown_proxy()

    r = asyncio.run(ask())
    assert r.status_code == 503, r.content
    assert r.json()["error"]["code"] == "insufficient_capacity"
    assert row(busy)[0].desired_state == "RUNNING"
