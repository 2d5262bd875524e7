"""GroupListener on a real Redis channel layer: listeners that wait with short timeouts lose
nothing, neither their own group's messages nor what other receivers of the process wait for,
and /readyz's ping comes back beside them.

channels-redis lets one receive of a process at a time wait on Redis (BZPOPMIN, 5 s), on its own
channel prefix's key, and hands what it pops to whichever channel it is for. /readyz's ping had a
prefix of its own, so it waited for the listeners' turns: 1 to 5.8 s a ping, past 10 s under
load (CI's PostgreSQL restart test timed out on /readyz). A listener that cancelled its receive
at each timeout could also drop what that receive had just popped."""
from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from channels.layers import get_channel_layer
from django.test import RequestFactory, override_settings

from live.groups import GroupListener, send
from tests.cluster.harness import REDIS_HOST
from xgenconsole.views import readyz

pytestmark = pytest.mark.cluster  # needs Redis on loopback


@pytest.fixture
def redis_layer():
    config = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                          "CONFIG": {"hosts": [f"redis://{REDIS_HOST}/13"], "prefix": f"t{uuid.uuid4().hex[:8]}"}}}
    with override_settings(CHANNEL_LAYERS=config):
        yield get_channel_layer()


async def test_listeners_timing_out_lose_no_message_of_the_process(redis_layer):
    group = f"g{uuid.uuid4().hex[:8]}"
    received: dict[float, list[dict]] = {0.003: [], 0.007: []}
    listeners = [GroupListener(group) for _ in received]

    async def listen(listener: GroupListener, timeout: float) -> None:
        while True:
            message = await listener.receive(timeout)
            if message is not None:
                received[timeout].append(message)

    tasks = [asyncio.create_task(listen(listener, timeout)) for listener, timeout in zip(listeners, received,
                                                                                         strict=True)]
    try:
        await asyncio.sleep(0.2)  # both joined the group
        lost = 0
        for i in range(300):
            channel = await redis_layer.new_channel()
            await redis_layer.send(channel, {"type": "ping", "n": i})
            try:
                async with asyncio.timeout(2):
                    assert (await redis_layer.receive(channel))["n"] == i
            except TimeoutError:
                lost += 1
            if i % 15 == 0:
                assert await send(group, {"type": "push", "n": i})
        await asyncio.sleep(0.5)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert lost == 0, f"{lost} of 300 round trips lost"
    for timeout, messages in received.items():
        assert [m["n"] for m in messages] == list(range(0, 300, 15)), timeout


async def test_a_cancelled_listener_leaves_no_receive_behind(redis_layer):
    listener = GroupListener(f"g{uuid.uuid4().hex[:8]}")
    before = asyncio.all_tasks()
    assert await listener.receive(0.05) is None
    pending = asyncio.all_tasks() - before
    assert len(pending) == 1 and not next(iter(pending)).done()  # the receive outlived the timeout
    task = asyncio.create_task(listener.receive(10))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert next(iter(pending)).cancelled()


@pytest.mark.django_db(transaction=True)
async def test_readyz_pings_the_layer_beside_the_process_listeners(redis_layer):
    """The proxy's routing table and the key cache each wait on a group, 1 s at a time."""
    listeners = [GroupListener(f"g{uuid.uuid4().hex[:8]}") for _ in range(2)]

    async def listen(listener: GroupListener) -> None:
        while True:
            await listener.receive(1.0)

    tasks = [asyncio.create_task(listen(listener)) for listener in listeners]
    try:
        await asyncio.sleep(0.2)
        answers = [json.loads((await readyz(RequestFactory().get("/readyz"))).content) for _ in range(20)]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # No node agent runs here (so 503), but the channel layer answered every time.
    assert all(a["reasons"] == ["no node agent has a fresh heartbeat"] for a in answers), answers


async def test_a_receive_with_no_message_for_long_is_started_afresh(redis_layer, monkeypatch):
    """A connection gone silent without an error must not hold the process's receivers for good."""
    from live.groups import Receiver

    monkeypatch.setattr(Receiver, "RESTART_S", 0.2)
    receiver = Receiver(redis_layer, await redis_layer.new_channel())
    before = asyncio.all_tasks()
    assert await receiver.receive(0.05) is None
    first = next(iter(asyncio.all_tasks() - before))
    assert await receiver.receive(0.05) is None and not first.done()  # within RESTART_S: the same receive
    await asyncio.sleep(0.2)
    assert await receiver.receive(0.05) is None
    await asyncio.sleep(0)
    assert first.cancelled()
    await redis_layer.send(receiver.channel, {"type": "after", "n": 1})
    assert (await receiver.receive(2))["n"] == 1  # the new receive gets what comes next
    receiver.close()


async def test_a_listener_whose_layer_fails_warns_once_and_again_when_back(caplog):
    """A web process's group listener that loses Redis says so at warning level (pushed key
    revocations and routing changes reach the process only by polling meanwhile): once per run of
    failures, not every retry, and once more when it listens again (issue 35 #3)."""
    import logging

    from tests.procs import free_port

    redis_host, redis_port = REDIS_HOST.split(":")
    port = free_port()  # nothing listens here until the relay below starts

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(redis_host, int(redis_port))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    config = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                          "CONFIG": {"hosts": [f"redis://127.0.0.1:{port}/13"], "prefix": f"t{uuid.uuid4().hex[:8]}"}}}
    caplog.set_level(logging.INFO, logger="xgen.live.groups")
    with override_settings(CHANNEL_LAYERS=config):
        listener = GroupListener(f"g{uuid.uuid4().hex[:8]}")
        for _ in range(3):
            assert await listener.receive(0.05) is None
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "channel layer failed" in warnings[0].getMessage(), caplog.text
        server = await asyncio.start_server(relay, "127.0.0.1", port)
        try:
            assert await listener.receive(0.3) is None  # joined: no message yet, no failure
            assert await send(listener.group, {"type": "push", "n": 1})
            message = None
            for _ in range(20):
                if (message := await listener.receive(0.1)) is not None:
                    break
            assert message is not None and message["n"] == 1
            assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
                f"group {listener.group}: listening again"]
            assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
        finally:
            listener.close()
            server.close()
