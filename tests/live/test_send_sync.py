"""send_sync / publish_sync from worker threads: a message sent while the event loop runs arrives,
and one sent after the loop stopped runs on a loop of the thread's own instead of waiting forever.

asgiref's async_to_sync schedules its coroutine on the thread's main loop and then waits with no
bound: a console sent SIGTERM during an unload stopped its loop while a run_db thread was about to
publish the instance's new state; the thread waited forever, and the process's exit waited on the
thread until the SIGKILL 30 s later."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.test import override_settings

from live.groups import call_on_main_loop, send_sync
from live.publish import publish_sync

IN_MEMORY = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


@override_settings(CHANNEL_LAYERS=IN_MEMORY)
def test_a_send_from_a_worker_thread_arrives_while_the_loop_runs():
    async def main() -> tuple[bool, dict, dict]:
        layer = get_channel_layer()
        channel = await layer.new_channel()
        await layer.group_add("watchers", channel)
        sent = await sync_to_async(send_sync, thread_sensitive=False)("watchers", {"type": "live.recheck"})
        first = await asyncio.wait_for(layer.receive(channel), 5)
        await sync_to_async(publish_sync, thread_sensitive=False)("watchers", "<p id=x>1</p>", key="x")
        second = await asyncio.wait_for(layer.receive(channel), 5)
        return sent, first, second

    sent, first, second = asyncio.run(main())
    assert sent is True
    assert first == {"type": "live.recheck"}
    assert second == {"type": "live.fragment", "html": "<p id=x>1</p>", "key": "x"}


@override_settings(CHANNEL_LAYERS=IN_MEMORY)
@pytest.mark.parametrize("close_loop", [False, True], ids=["stopped", "closed"])
def test_a_send_after_the_loop_stopped_does_not_wait_on_it(close_loop):
    loop = asyncio.new_event_loop()
    started, release, done = threading.Event(), threading.Event(), threading.Event()
    answers: list[object] = []

    def worker() -> None:
        started.set()
        release.wait(10)
        answers.append(send_sync("watchers", {"type": "live.recheck"}))
        answers.append(publish_sync("watchers", "<p>late</p>"))
        done.set()

    async def main() -> None:
        # The worker runs as a run_db thread does (sync_to_async sets its main loop); the loop
        # stops without waiting for it, as a console's loop does on SIGTERM.
        loop.create_task(sync_to_async(worker, thread_sensitive=False)())
        await asyncio.to_thread(started.wait, 10)

    try:
        loop.run_until_complete(main())
        if close_loop:
            executor = loop._default_executor  # the worker's thread: closing the loop must not join it yet
            loop._default_executor = None
            loop.close()
        release.set()
        assert done.wait(10), "send_sync waited on an event loop that had stopped"
        assert answers == [True, None]  # sent on a loop of the thread's own (a group with no member)
    finally:
        release.set()
        if not done.is_set() and not loop.is_closed():
            loop.run_until_complete(asyncio.sleep(0.5))  # lets the old async_to_sync finish its wait
        if close_loop:
            executor.shutdown(wait=False)
        else:
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()


def test_it_refuses_to_block_an_event_loops_own_thread(monkeypatch):
    from asgiref.sync import SyncToAsync

    async def main() -> None:
        monkeypatch.setattr(SyncToAsync.threadlocal, "main_event_loop", asyncio.get_running_loop(), raising=False)
        monkeypatch.setattr(SyncToAsync.threadlocal, "main_event_loop_pid", os.getpid(), raising=False)
        with pytest.raises(RuntimeError, match="event loop's thread"):
            call_on_main_loop(asyncio.sleep, 0, timeout=1, default=None)

    asyncio.run(main())
