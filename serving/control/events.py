"""The console's channel-layer groups and the messages the planes send each other: a node's nudge
group, the routing group every web process's routing table listens on, and the instance pages'
groups (log lines from the node's supervisor). The page updates after a state change are the web
side's (serving/web/live.py).

Groups: "instances" (the list page) and "instance.<id>" (one instance's page). Fragments carry
data-version, so a page's catch-up fetch and the websocket can race without an older
fragment overwriting a newer one (static/js/live_versions.js).
"""
from __future__ import annotations

import logging

from django.dispatch import receiver
from django.utils.html import escape

from live.groups import send_sync
from live.publish import publish
from serving.models import InstanceEvent, ModelInstance, instance_changed

log = logging.getLogger("xgen.serving")

LIST_GROUP = "instances"
# Every web process's routing table listens here: a state change anywhere refreshes them all.
ROUTING_GROUP = "routing"


def node_group(name: str) -> str:
    """Channel-layer group that nudges the agent of node `name`."""
    return f"node.{name}"


def instance_group(instance_id: int) -> str:
    return f"instance.{instance_id}"


def routing_changed() -> None:
    """Tell every web process's routing table to re-read the database now (sync)."""
    send_sync(ROUTING_GROUP, {"type": "routing.changed"})  # bounded; the tables also refresh every second


@receiver(instance_changed, dispatch_uid="serving.control.events.routing_changed")
def _on_instance_changed(sender, *, instance: ModelInstance, event: InstanceEvent | None, progress_only: bool,
                         **kwargs) -> None:
    if event is not None:  # a state change: every web process's routing table re-reads the database now
        routing_changed()


def log_fragment(lines: list[str], offset: int) -> str:
    body = "".join(f'<span class="line">{escape(line)}</span>' for line in lines)
    return f'<div hx-swap-oob="beforeend:#log" data-version="{offset}">{body}</div>'


async def log_lines(instance_id: int, lines: list[str], offset: int = 0) -> None:
    """Append log lines on the instance page; `offset` is the log file position after them."""
    if lines:
        await publish(instance_group(instance_id), log_fragment(lines, offset))
