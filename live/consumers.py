"""One consumer class serves every live page. It refuses anonymous users, joins the groups the
URL names, and coalesces: a fragment that replaces an element (keyed by its id) overwrites a
pending one, appended lines (log) are bounded, and everything is flushed at most every
FLUSH_S, so a burst of events never floods a slow browser or the server.
"""
from __future__ import annotations

import asyncio

from channels.generic.websocket import AsyncWebsocketConsumer

from live.publish import GROUP_RE

FLUSH_S = 0.2
MAX_APPENDS = 500


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
