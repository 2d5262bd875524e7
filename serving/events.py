"""Live updates for instance pages: typed wrappers around xgenconsole.live.publish.

Groups: "instances" (the list page) and "instance.<id>" (one instance's page). Fragments carry
data-version, so a page's catch-up fetch and the websocket can race without an older
fragment overwriting a newer one (static/js/live_versions.js).
"""
from __future__ import annotations

from django.template.loader import render_to_string
from django.utils.html import escape

from serving.models import InstanceEvent, ModelInstance
from xgenconsole.live import publish, publish_sync

LIST_GROUP = "instances"
TIMELINE_ROWS = 100


def instance_group(instance_id: int) -> str:
    return f"instance.{instance_id}"


def timeline_events(instance_id: int) -> list[InstanceEvent]:
    """The newest TIMELINE_ROWS events, oldest first."""
    return list(reversed(InstanceEvent.objects.filter(instance_id=instance_id).order_by("-at", "-pk")[:TIMELINE_ROWS]))


def timeline_html(instance_id: int, *, oob: bool) -> str:
    """The whole timeline, versioned by its newest event (each snapshot is complete: the newest wins)."""
    evs = timeline_events(instance_id)
    return render_to_string("serving/partials/_timeline.html",
                            {"events": evs, "version": evs[-1].pk if evs else 0, "oob": oob})


def state_changed(instance: ModelInstance, event: InstanceEvent | None = None) -> None:
    """The row on the list page, the state block and (after a transition) the timeline of its page (sync)."""
    if event is not None and not event.from_state:
        publish_sync(LIST_GROUP, list_body_html(), key="instances-body")  # a new row: the list page gains it
    else:
        row = render_to_string("serving/partials/_instance_row.html", {"i": instance, "oob": True})
        publish_sync(LIST_GROUP, row, key=f"inst-row-{instance.pk}")
    publish_sync(LIST_GROUP, ready_count_html(oob=True), key="ready-count")
    state = render_to_string("serving/partials/_instance_state.html", {"inst": instance, "oob": True})
    publish_sync(instance_group(instance.pk), state, key=f"inst-state-{instance.pk}")
    if event is not None:
        publish_sync(instance_group(instance.pk), timeline_html(instance.pk, oob=True), key=f"timeline-{instance.pk}")


def ready_count_html(*, oob: bool) -> str:
    from serving.models import ACTIVE_STATES, InstanceState

    active = ModelInstance.objects.filter(state__in=ACTIVE_STATES)
    ready, total = active.filter(state=InstanceState.READY).count(), active.count()
    attr = ' hx-swap-oob="true"' if oob else ""
    return f'<span class="muted" id="ready-count"{attr}>{ready} ready of {total} active</span>'


def list_body_html() -> str:
    instances = list(ModelInstance.objects.select_related("node")[:200])
    return render_to_string("serving/partials/_instances_body.html", {
        "instances": instances, "oob": True, "can_operate": True, "list_version": max((i.live_version for i in instances), default=0)})


def log_fragment(lines: list[str], offset: int) -> str:
    body = "".join(f'<span class="line">{escape(line)}</span>' for line in lines)
    return f'<div hx-swap-oob="beforeend:#log" data-version="{offset}">{body}</div>'


async def log_lines(instance_id: int, lines: list[str], offset: int = 0) -> None:
    """Append log lines on the instance page; `offset` is the log file position after them."""
    if lines:
        await publish(instance_group(instance_id), log_fragment(lines, offset))
