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


async def _signed_in_socket(client, account):
    """A live socket opened with the real session a browser sign-in made (scope as AuthMiddleware sets it)."""
    from importlib import import_module

    from asgiref.sync import sync_to_async
    from django.conf import settings

    await sync_to_async(client.login)(username=account.user.username, password=account.password)
    session = import_module(settings.SESSION_ENGINE).SessionStore(client.session.session_key)
    comm = WebsocketCommunicator(DemoConsumer.as_asgi(), "/ws/demo/")
    comm.scope["user"] = account.user
    comm.scope["session"] = session
    connected, _ = await comm.connect()
    assert connected
    return comm


async def _closed(comm) -> int:
    message = await comm.receive_output(timeout=3)  # pushed: no wait for the periodic check
    assert message["type"] == "websocket.close", message
    return message["code"]


@pytest.mark.django_db(transaction=True)
async def test_a_live_page_closes_when_its_user_signs_out(viewer):
    from asgiref.sync import sync_to_async
    from django.test import Client

    client = Client()
    comm = await _signed_in_socket(client, viewer)
    await sync_to_async(client.logout)()
    assert await _closed(comm) == 4401


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", ["deactivated", "demoted", "new password"])
async def test_a_live_page_closes_when_its_user_changes(viewer, change):
    from asgiref.sync import sync_to_async
    from django.test import Client

    comm = await _signed_in_socket(Client(), viewer)

    def apply():
        user = type(viewer.user).objects.get(pk=viewer.user.pk)
        if change == "deactivated":
            user.is_active = False
        elif change == "demoted":
            user.role = "operator" if user.role == "viewer" else "viewer"
        else:
            user.set_password("another-pass-456")
        user.save()

    await sync_to_async(apply)()
    assert await _closed(comm) == 4401


@pytest.mark.django_db(transaction=True)
async def test_a_live_page_stays_open_for_an_unrelated_save(viewer):
    from asgiref.sync import sync_to_async
    from django.test import Client

    comm = await _signed_in_socket(Client(), viewer)
    await sync_to_async(lambda: type(viewer.user).objects.get(pk=viewer.user.pk).save())()
    assert await comm.receive_nothing(timeout=1)
    await publish("demo.group", "<p>still here</p>", key="x")
    assert await comm.receive_from(timeout=2) == "<p>still here</p>"
    await comm.disconnect()
