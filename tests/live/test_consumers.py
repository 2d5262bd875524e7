"""The shared live-fragment websocket consumer: auth, groups, coalescing."""
import asyncio

import pytest
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser

from live.consumers import LiveConsumer
from live.publish import publish


class DemoConsumer(LiveConsumer):
    def groups_for(self):
        return ["demo.group"]


@pytest.mark.django_db(transaction=True)
async def test_anonymous_is_refused():
    comm = WebsocketCommunicator(DemoConsumer.as_asgi(), "/ws/demo/")
    comm.scope["user"] = AnonymousUser()
    connected, code = await comm.connect()
    assert not connected and code == 4401


@pytest.mark.django_db(transaction=True)
async def test_fragments_are_coalesced_by_key_and_appends_kept(viewer):
    comm = WebsocketCommunicator(DemoConsumer.as_asgi(), "/ws/demo/")
    comm.scope["user"] = viewer.user
    connected, _ = await comm.connect()
    assert connected
    await publish("demo.group", "<p>first</p>", key="x")
    await comm.receive_from(timeout=2)
    # A burst while the flusher waits: three versions of x, two log lines.
    for i in range(3):
        await publish("demo.group", f'<div id="x">{i}</div>', key="x")
    await publish("demo.group", "<span>line 1</span>")
    await publish("demo.group", "<span>line 2</span>")
    await asyncio.sleep(0.4)
    text = await comm.receive_from(timeout=2)
    assert text == '<span>line 1</span><span>line 2</span><div id="x">2</div>'
    assert await comm.receive_nothing(timeout=0.5)
    await comm.disconnect()
