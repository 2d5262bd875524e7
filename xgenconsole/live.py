"""Live pages: background code publishes rendered HTML fragments to a group; browsers on a
page join that group over a websocket (htmx ws extension swaps fragments in by element id).

One consumer class serves every live page. It refuses anonymous users, joins the groups the
URL names, and coalesces: a fragment that replaces an element (keyed by its id) overwrites a
pending one, appended lines (log) are bounded, and everything is flushed at most every
FLUSH_S, so a burst of events never floods a slow browser or the server.
"""
from __future__ import annotations

import asyncio
import logging
import re

from asgiref.sync import async_to_sync
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)

FLUSH_S = 0.2
MAX_APPENDS = 500
GROUP_RE = re.compile(r"^[A-Za-z0-9._-]{1,90}$")


async def publish(group: str, html: str, *, key: str | None = None) -> None:
    """Send a fragment to every browser watching `group`.

    `key` (usually the element id the fragment replaces) lets consumers drop stale versions;
    None means the fragment appends (a log line) and is never merged with another.
    """
    layer = get_channel_layer()
    if layer is None or not GROUP_RE.match(group):
        return
    try:
        await layer.group_send(group, {"type": "live.fragment", "html": html, "key": key})
    except Exception:  # a full or unreachable channel layer must never break the caller
        log.warning("live publish to %s failed", group, exc_info=True)


def publish_sync(group: str, html: str, *, key: str | None = None) -> None:
    async_to_sync(publish)(group, html, key=key)


class LiveConsumer(AsyncWebsocketConsumer):
    """Subclasses set `groups_for()`; everything else is shared."""

    def groups_for(self) -> list[str]:
        raise NotImplementedError

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_active:
            await self.close(code=4401)
            return
        self._groups = [g for g in self.groups_for() if GROUP_RE.match(g)]
        self._keyed: dict[str, str] = {}
        self._appends: list[str] = []
        self._wake = asyncio.Event()
        for group in self._groups:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()
        self._flusher = asyncio.create_task(self._flush_loop())

    async def disconnect(self, code: int) -> None:
        for group in getattr(self, "_groups", []):
            await self.channel_layer.group_discard(group, self.channel_name)
        flusher = getattr(self, "_flusher", None)
        if flusher:
            flusher.cancel()

    async def receive(self, text_data=None, bytes_data=None) -> None:
        """Browsers only listen; anything they send is ignored."""

    async def live_fragment(self, event: dict) -> None:
        key = event.get("key")
        if key:
            self._keyed.pop(key, None)  # keep arrival order: the newest goes last
            self._keyed[key] = event["html"]
        else:
            self._appends.append(event["html"])
            if len(self._appends) > MAX_APPENDS:
                del self._appends[: len(self._appends) - MAX_APPENDS]
        self._wake.set()

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            keyed, appends = self._keyed, self._appends
            self._keyed, self._appends = {}, []
            parts = appends + list(keyed.values())
            if parts:
                await self.send(text_data="".join(parts))
            await asyncio.sleep(FLUSH_S)
