"""One member of a channel-layer group, for a process's background loop: joins (and renews the
membership before channels-redis forgets it), waits a bounded time for the next message, and
survives a channel layer that is down (Redis restarting) by trying again later."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("xgen.live.groups")

T = TypeVar("T")

LAYER_TIMEOUT_S = 5.0  # a layer call that hangs (Redis restarting) must not stall its caller's loop
SEND_TIMEOUT_S = 2.0  # a message is a hint (every receiver also polls): never wait long to send one
SYNC_SEND_WAIT_S = SEND_TIMEOUT_S + 2.0  # a sync caller's wait for a send on the main loop (call_on_main_loop)


async def send(group: str, message: dict[str, Any]) -> bool:
    """Send to every member of `group`, at most SEND_TIMEOUT_S: a channel layer that hangs (Redis
    busy or restarting) must never hold up a state change, a page or a request. False when the
    message could not be sent (logged); the receivers' own refresh catches up."""
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    if layer is None:
        return False
    try:
        async with asyncio.timeout(SEND_TIMEOUT_S):
            await layer.group_send(group, message)
        return True
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # TimeoutError included
        log.warning("sending %s to %s failed: %s", message.get("type"), group, exc.__class__.__name__ or exc)
        return False


async def watched(groups: list[str]) -> set[str]:
    """Which of `groups` have a member now: a fragment for a group nobody watches need not be
    rendered (a page that joins later renders its own state when its socket opens). The in-memory
    layer's own table; channels-redis' group sets (one ZCOUNT each, members joined within its
    group_expiry, in one pipeline); any other layer, or a layer that fails or hangs: every group
    (rendering for nobody costs time, never a missed update)."""
    from channels.layers import InMemoryChannelLayer, get_channel_layer

    layer = get_channel_layer()
    if layer is None:
        return set()
    if isinstance(layer, InMemoryChannelLayer):
        return {g for g in groups if layer.groups.get(g)}
    try:
        from channels_redis.core import RedisChannelLayer  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - a dependency of cluster mode
        return set(groups)
    if not isinstance(layer, RedisChannelLayer):
        return set(groups)
    try:
        async with asyncio.timeout(SEND_TIMEOUT_S):
            since = int(time.time()) - layer.group_expiry
            found = set()
            for group in groups:
                connection = layer.connection(layer.consistent_hash(group))
                if await connection.zcount(layer._group_key(group), since, "+inf"):
                    found.add(group)
            return found
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # TimeoutError included: render for every group, as before
        log.warning("reading who watches %s failed: %s", ", ".join(groups)[:200], exc.__class__.__name__ or exc)
        return set(groups)


def watched_sync(groups: list[str]) -> set[str]:
    """`watched` for synchronous callers (every group when it cannot say in time)."""
    from channels.layers import InMemoryChannelLayer, get_channel_layer

    layer = get_channel_layer()
    if isinstance(layer, InMemoryChannelLayer):  # a dict read: no hop to the event loop
        return {g for g in groups if layer.groups.get(g)}
    return call_on_main_loop(watched, list(groups), timeout=SYNC_SEND_WAIT_S, default=set(groups))


def call_on_main_loop(fn: Callable[..., Coroutine[Any, Any, T]], *args: Any, timeout: float,
                      default: T, **kwargs: Any) -> T:
    """`async_to_sync(fn)(*args, **kwargs)` that never waits past `timeout` seconds on another loop.

    A worker thread that sync_to_async started (run_db's, Django's) runs `fn` on its main event
    loop. asgiref's async_to_sync waits for that with no bound, and when that loop has stopped
    without closing (a SIGTERM during an unload) it waits forever: the process's exit then waited
    on the thread (seen: a console up until its SIGKILL 30 s later). Here the wait on a running
    main loop is bounded (`default` after `timeout`), and a thread whose main loop is not running
    (stopped, closed, or left behind by an async_to_sync that ended) runs `fn` on a loop of its
    own, as a thread with no main loop does.
    """
    from asgiref.sync import SyncToAsync, async_to_sync

    loop = getattr(SyncToAsync.threadlocal, "main_event_loop", None)
    if getattr(SyncToAsync.threadlocal, "main_event_loop_pid", None) != os.getpid():
        loop = None
    if loop is None:
        return async_to_sync(fn)(*args, **kwargs)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:  # on an event loop's own thread: waiting here would block the loop it waits for
        raise RuntimeError("call_on_main_loop() cannot be used from an event loop's thread; await it")
    coro = fn(*args, **kwargs)
    if loop.is_closed() or not loop.is_running():
        return asyncio.run(coro)
    try:
        future = asyncio.run_coroutine_threadsafe(coro, loop)
    except RuntimeError:  # the loop closed between the check and the call
        return asyncio.run(coro)
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        log.warning("%s did not run within %.0f s (the event loop is stopping or blocked)",
                    getattr(fn, "__name__", fn), timeout)
        return default
    except concurrent.futures.CancelledError:  # the loop cancelled it on its way out
        return default


def send_sync(group: str, message: dict[str, Any]) -> bool:
    """`send` for synchronous callers (not on an event loop thread); False when it could not be sent."""
    return call_on_main_loop(send, group, message, timeout=SYNC_SEND_WAIT_S, default=False)


GROUP_RENEW_S = 300.0  # channels-redis forgets a group member after its group_expiry


class Receiver:
    """`layer.receive(channel)` that a timeout never cancels.

    channels-redis pops a message for any of the process's channels in whichever receive holds its
    lock; cancelling that receive between Redis's pop and the reply's arrival drops the message,
    whoever it was for (a /readyz ping, a routing push, a websocket's fragment): 1 of 2,300 round
    trips lost beside two receivers cancelled every 3 and 7 ms. So the receive runs as a task that
    outlives a timeout, and the next wait takes up the same task. Every receiver of a process uses
    the default channel prefix: one receive at a time waits on Redis, on its own prefix's key.

    A receive with no message for RESTART_S is started afresh (cancelled: the one rare moment a
    message could be lost, and every listener also polls), so a connection that went silent
    without an error (a network cut, no reset) holds the process's receivers RESTART_S at most.
    """

    RESTART_S = 30.0

    def __init__(self, layer: Any, channel: str) -> None:
        self.layer = layer
        self.channel = channel
        self._task: asyncio.Task[Any] | None = None
        self._since = 0.0

    async def receive(self, timeout: float) -> dict[str, Any] | None:
        """The next message, or None after `timeout` seconds (the receive goes on for the next call).
        Raises what the receive raised (the layer is down)."""
        if self._task is not None and time.monotonic() - self._since > self.RESTART_S:
            self.close()
        if self._task is None:
            self._task = asyncio.ensure_future(self.layer.receive(self.channel))
            self._since = time.monotonic()
        try:
            done, _ = await asyncio.wait({self._task}, timeout=timeout)
        except asyncio.CancelledError:
            self.close()
            raise
        if not done:
            return None
        task, self._task = self._task, None
        return task.result()

    def close(self) -> None:
        """Cancel the receive in flight (shutdown, or a channel given up)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()


class GroupListener:
    def __init__(self, group: str) -> None:
        self.group = group
        self._layer = None
        self._looked_up = False
        self._receiver: Receiver | None = None
        self._joined_at = 0.0
        self._failing = False  # warned once for the current run of failures

    async def receive(self, timeout: float) -> dict[str, Any] | None:
        """The next message sent to the group, or None after `timeout` seconds without one (also
        when there is no channel layer, or it is down: then the membership is made again next time)."""
        if not self._looked_up:
            from channels.layers import get_channel_layer

            self._layer, self._looked_up = get_channel_layer(), True
        layer = self._layer
        if layer is None:
            await asyncio.sleep(timeout)
            return None
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 a wait_for whose timeout fires as its task
            # is cancelled drops the cancellation, and the loop's shutdown waits for this task forever.
            if self._receiver is None or time.monotonic() - self._joined_at > GROUP_RENEW_S:
                async with asyncio.timeout(LAYER_TIMEOUT_S):
                    if self._receiver is None:
                        self._receiver = Receiver(layer, await layer.new_channel())
                    await layer.group_add(self.group, self._receiver.channel)
                self._joined_at = time.monotonic()
            message = await self._receiver.receive(timeout)
        except asyncio.CancelledError:
            self.close()
            raise
        except Exception as exc:
            # A warning (once per run of failures, not every `timeout`): while it lasts, pushed
            # changes (key revocations, routing) reach this process only by its polling.
            if not self._failing:
                log.warning("group %s: the channel layer failed (%s: %s); joining again every %.0f s",
                            self.group, exc.__class__.__name__, exc, timeout)
            log.debug("group %s unavailable", self.group, exc_info=True)
            self._failing = True
            self.close()
            await asyncio.sleep(timeout)
            return None
        if self._failing:
            self._failing = False
            log.info("group %s: listening again", self.group)
        return message

    def close(self) -> None:
        receiver, self._receiver, self._joined_at = self._receiver, None, 0.0
        if receiver is not None:
            receiver.close()


__all__ = ["GroupListener", "LAYER_TIMEOUT_S", "Receiver", "call_on_main_loop", "send", "send_sync"]
