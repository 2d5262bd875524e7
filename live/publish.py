"""Publishing a rendered fragment to every browser watching a group (apps wrap this in events.py)."""
from __future__ import annotations

import logging
import re

from live.groups import SYNC_SEND_WAIT_S, call_on_main_loop, send, send_sync

log = logging.getLogger(__name__)

GROUP_RE = re.compile(r"^[A-Za-z0-9._-]{1,90}$")


async def publish(group: str, html: str, *, key: str | None = None) -> None:
    """Send a fragment to every browser watching `group`.

    `key` (usually the element id the fragment replaces) lets consumers drop stale versions;
    None means the fragment appends (a log line) and is never merged with another.
    """
    if not GROUP_RE.match(group):
        return
    await send(group, {"type": "live.fragment", "html": html, "key": key})  # bounded; never raises


def publish_sync(group: str, html: str, *, key: str | None = None) -> None:
    """`publish` for synchronous callers."""
    call_on_main_loop(publish, group, html, key=key, timeout=SYNC_SEND_WAIT_S, default=None)


def user_group(user_id: int) -> str:
    """Every live page a user has open joins this group: a sign-out or a change to the user
    (deactivated, another role, a new password) makes them check the user again at once."""
    return f"user.{int(user_id)}"


def user_changed_sync(user_id: int) -> None:
    """Tell every open live page of `user_id` to check its user again (sync callers)."""
    send_sync(user_group(user_id), {"type": "live.recheck"})  # the pages also check every LIVE_RECHECK_S
