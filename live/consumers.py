"""One consumer class serves every live page. It refuses anonymous users, joins the groups the
URL names, and coalesces: a fragment that replaces an element (keyed by its id) overwrites a
pending one, appended lines (log) are bounded, and everything is flushed at most every
FLUSH_S, so a burst of events never floods a slow browser or the server.

A page stays open only while its user may still see it: the user is checked again when they
sign out or change (pushed to `user.<id>`) and every LIVE_RECHECK_S, and the socket is closed
(4401) once the session is gone, the user is inactive, or their role or password changed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from channels.generic.websocket import AsyncWebsocketConsumer

from live.db import run_db
from live.publish import GROUP_RE, user_group

log = logging.getLogger(__name__)

FLUSH_S = 0.2
MAX_APPENDS = 500
LIVE_RECHECK_S = 5.0


@dataclass(frozen=True)
class Viewer:
    """Who opened the page, as it was then."""

    user_id: int
    session_key: str | None
    auth_hash: str
    role: str | None
    is_superuser: bool


def _viewer(user: Any, session: Any) -> Viewer:
    return Viewer(user_id=user.pk, session_key=getattr(session, "session_key", None),
                  auth_hash=user.get_session_auth_hash(), role=getattr(user, "role", None),
                  is_superuser=bool(getattr(user, "is_superuser", False)))


def _still_allowed(viewer: Viewer) -> bool:
    """Whether the page's user may still see it: same session, active, same role and password."""
    from importlib import import_module

    from django.conf import settings
    from django.contrib.auth import HASH_SESSION_KEY, SESSION_KEY, get_user_model

    user = get_user_model().objects.filter(pk=viewer.user_id).first()
    if user is None or not user.is_active or _viewer(user, None).auth_hash != viewer.auth_hash:
        return False
    if getattr(user, "role", None) != viewer.role or bool(user.is_superuser) != viewer.is_superuser:
        return False
    if viewer.session_key is None:
        return True  # a socket without a session (tests, other auth): the user alone decides
    store = import_module(settings.SESSION_ENGINE).SessionStore(viewer.session_key)
    return str(store.get(SESSION_KEY)) == str(viewer.user_id) and store.get(HASH_SESSION_KEY) == viewer.auth_hash


class LiveConsumer(AsyncWebsocketConsumer):
    """Subclasses set `groups_for()`; everything else is shared."""

    def groups_for(self) -> list[str]:
        raise NotImplementedError

    def skipped_keys(self) -> frozenset[str]:
        """Keyed fragments of the groups that this page does not show (dropped, not sent)."""
        return frozenset()

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_active:
            await self.close(code=4401)
            return
        self._viewer = await run_db(_viewer, user, self.scope.get("session"))
        self._groups = [g for g in self.groups_for() if GROUP_RE.match(g)] + [user_group(user.pk)]
        self._keyed: dict[str, str] = {}
        self._skipped = self.skipped_keys()
        self._appends: list[str] = []
        self._wake = asyncio.Event()
        for group in self._groups:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()
        self._flusher = asyncio.create_task(self._flush_loop())
        self._checker = asyncio.create_task(self._recheck_loop())

    async def disconnect(self, code: int) -> None:
        for group in getattr(self, "_groups", []):
            await self.channel_layer.group_discard(group, self.channel_name)
        for name in ("_flusher", "_checker"):
            task = getattr(self, name, None)
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        """Browsers only listen; anything they send is ignored."""

    async def live_recheck(self, event: dict[str, Any]) -> None:
        await self._recheck()

    async def _recheck(self) -> bool:
        """Close the socket when its user may no longer see the page; True while they may."""
        try:
            allowed = await run_db(_still_allowed, self._viewer)
        except Exception:  # the database is down: keep the page; the next check decides
            log.warning("live recheck of user %s failed", self._viewer.user_id, exc_info=True)
            return True
        if not allowed:
            await self.close(code=4401)
        return allowed

    async def _recheck_loop(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                await asyncio.sleep(LIVE_RECHECK_S)
                if not await self._recheck():
                    return

    async def live_fragment(self, event: dict[str, Any]) -> None:
        key = event.get("key")
        if key in self._skipped:
            return
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
