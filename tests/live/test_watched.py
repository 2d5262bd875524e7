"""Which groups a page watches (live.groups.watched): a state change renders the fragments of
watched groups only (rendering the list, the instance page and three dashboards for nobody took
~30 ms of every state change of a load, bench/load_time.py). Sending to a group nobody is in
reaches nobody, so skipping it changes nothing a page sees."""
from __future__ import annotations

import asyncio
import socket
import uuid

import pytest
from channels.layers import get_channel_layer
from django.test import override_settings

from live.groups import watched, watched_sync

IN_MEMORY = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


def _redis(port: int = 6379) -> dict:
    return {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                        "CONFIG": {"hosts": [f"redis://127.0.0.1:{port}/13"], "prefix": f"t{uuid.uuid4().hex[:8]}"}}}


@pytest.mark.parametrize("layer", ["memory", "redis"])
def test_a_group_is_watched_while_a_channel_is_in_it(layer):
    async def main() -> list[set[str]]:
        channels = get_channel_layer()
        seen = [await watched(["a", "b"])]
        channel = await channels.new_channel()
        await channels.group_add("a", channel)
        seen.append(await watched(["a", "b"]))
        await channels.group_discard("a", channel)
        seen.append(await watched(["a", "b"]))
        return seen

    with override_settings(CHANNEL_LAYERS=IN_MEMORY if layer == "memory" else _redis()):
        assert asyncio.run(main()) == [set(), {"a"}, set()]


def test_a_redis_that_does_not_answer_counts_every_group_as_watched(caplog):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts, never answers
    try:
        with override_settings(CHANNEL_LAYERS=_redis(silent.getsockname()[1])):
            assert asyncio.run(watched(["a", "b"])) == {"a", "b"}
    finally:
        silent.close()
    assert "reading who watches a, b failed" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_state_change_is_rendered_for_the_groups_watched_only():
    from hardware.services import register_node
    from serving.control.events import LIST_GROUP, instance_group
    from serving.models import InstanceEvent, ModelInstance
    from serving.web.live import state_changed

    node = register_node(name="n", address="127.0.0.1")
    inst = ModelInstance.objects.create(model_name="m", model_path="/x", backend="llama-server", node=node,
                                        state="READY")
    event = InstanceEvent.objects.create(instance=inst, from_state="WARMING", to_state="READY", message="ready")

    async def main() -> tuple[set[str], list[str], list[str]]:
        channels = get_channel_layer()
        page = await channels.new_channel()
        await channels.group_add(instance_group(inst.pk), page)
        watching = await asyncio.to_thread(watched_sync, [LIST_GROUP, instance_group(inst.pk)])
        await asyncio.to_thread(state_changed, inst, event)
        keys = []
        while True:
            try:
                keys.append((await asyncio.wait_for(channels.receive(page), 0.5))["key"])
            except TimeoutError:
                break
        return watching, keys, list(channels.groups)

    with override_settings(CHANNEL_LAYERS=IN_MEMORY):
        watching, keys, groups = asyncio.run(main())
    assert watching == {instance_group(inst.pk)}
    assert keys == [f"inst-state-{inst.pk}", f"timeline-{inst.pk}"]
    assert groups == [instance_group(inst.pk)]  # nothing else was sent anywhere
