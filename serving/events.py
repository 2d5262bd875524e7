"""Live updates for instance pages: typed wrappers around xgenconsole.live.publish.

Groups: "instances" (the list page) and "instance.<id>" (one instance's page).
"""
from __future__ import annotations

from django.template.loader import render_to_string
from django.utils.html import escape

from serving.models import InstanceEvent, ModelInstance
from xgenconsole.live import publish, publish_sync

LIST_GROUP = "instances"


def instance_group(instance_id: int) -> str:
    return f"instance.{instance_id}"


def state_changed(instance: ModelInstance, event: InstanceEvent | None = None) -> None:
    """The row on the list page, the state block on the detail page, and a timeline entry (sync)."""
    row = render_to_string("serving/partials/_instance_row.html", {"i": instance, "oob": True})
    publish_sync(LIST_GROUP, row, key=f"inst-row-{instance.pk}")
    state = render_to_string("serving/partials/_instance_state.html", {"inst": instance, "oob": True})
    publish_sync(instance_group(instance.pk), state, key=f"inst-state-{instance.pk}")
    if event is not None:
        entry = render_to_string("serving/partials/_event.html", {"e": event})
        publish_sync(instance_group(instance.pk), f'<tbody hx-swap-oob="beforeend:#timeline">{entry}</tbody>')


def log_fragment(lines: list[str]) -> str:
    body = "".join(f'<span class="line">{escape(line)}</span>' for line in lines)
    return f'<div hx-swap-oob="beforeend:#log">{body}</div>'


async def log_lines(instance_id: int, lines: list[str]) -> None:
    """Append log lines on the instance page (the consumer bounds and coalesces them)."""
    if lines:
        await publish(instance_group(instance_id), log_fragment(lines))
