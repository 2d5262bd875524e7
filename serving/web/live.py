"""Live updates of the instance pages after a change of an instance (the model's `instance_changed`
signal, sent after the commit): the list card, the row's state cell, the state block and the
timeline of its page, and the dashboard's states. The groups are serving.control.events'."""
from __future__ import annotations

from django.dispatch import receiver
from django.template.loader import render_to_string

from live.groups import watched_sync
from live.publish import publish_sync
from serving.control.events import LIST_GROUP, instance_group
from serving.models import InstanceEvent, ModelDeployment, ModelInstance, instance_changed
from serving.web.dashboard import RANGES, dashboard_group, states_changed

TIMELINE_ROWS = 100


def timeline_events(instance_id: int) -> list[InstanceEvent]:
    """The newest TIMELINE_ROWS events, oldest first."""
    return list(reversed(InstanceEvent.objects.filter(instance_id=instance_id).order_by("-at", "-pk")[:TIMELINE_ROWS]))


def timeline_html(instance_id: int, *, oob: bool) -> str:
    """The whole timeline, versioned by its newest event (each snapshot is complete: the newest wins)."""
    evs = timeline_events(instance_id)
    return render_to_string("serving/partials/_timeline.html",
                            {"events": evs, "version": evs[-1].pk if evs else 0, "oob": oob})


def state_changed(instance: ModelInstance, event: InstanceEvent | None = None, *,
                  progress_only: bool = False) -> None:
    """Live updates after a change of the instance (sync).

    A state change: the list's first page (card and ready count), the row's state cell (what
    the later pages follow), the state block and (with a timeline row) the timeline of its page
    (the routing tables are told by serving.control.events' own receiver).
    A progress tick (CACHING %): only that instance's state block and its row's state cell; the
    card is not rendered again every 0.5 s.
    """
    group = instance_group(instance.pk)
    dashboards = [dashboard_group(name) for name in RANGES]
    watching = watched_sync([LIST_GROUP, group, *dashboards])  # nobody's page: nothing to render
    if LIST_GROUP in watching:
        if not progress_only:
            # The whole list card (page 1), not rows: the consumer joins fragments into one message, and a
            # <tr> beside a non-table element does not survive HTML parsing. Bursts coalesce by key.
            ctx = instances_context(can_operate=True)  # operator buttons always; viewers' pages hide them
            publish_sync(LIST_GROUP, render_to_string("serving/partials/_instances_card.html", {**ctx, "oob": True}),
                         key="instances-card")
            publish_sync(LIST_GROUP, render_to_string("serving/partials/_ready_count.html", {**ctx, "oob": True}),
                         key="ready-count")
        # The row's state cell: all a progress tick sends, and how later pages follow their rows.
        cell = render_to_string("serving/partials/_instance_row_state.html", {"i": instance, "oob": True})
        publish_sync(LIST_GROUP, cell, key=f"inst-row-state-{instance.pk}")
    if group in watching:
        state = render_to_string("serving/partials/_instance_state.html", {"inst": instance, "oob": True})
        publish_sync(group, state, key=f"inst-state-{instance.pk}")
        if event is not None:
            publish_sync(group, timeline_html(instance.pk, oob=True), key=f"timeline-{instance.pk}")
    if event is not None and watching.intersection(dashboards):
        states_changed()


@receiver(instance_changed, dispatch_uid="serving.web.live.state_changed")
def _on_instance_changed(sender, *, instance: ModelInstance, event: InstanceEvent | None, progress_only: bool,
                         **kwargs) -> None:
    state_changed(instance, event, progress_only=progress_only)


INSTANCES_PAGE = 50  # rows a list page renders (200 rows took 154 ms of server time; bench/pages.py)


def instances_context(*, can_operate: bool, page: int = 1) -> dict:
    """What the list card shows: one page of instances (newest first), the ready count, the
    pager, and the card's version. Page 1's card is the one the websocket pushes; the others
    keep their id apart (the push would replace them with page 1) and follow their rows' states
    through the row-state cells every change also publishes."""
    from serving.models import ACTIVE_STATES, InstanceState

    count = ModelInstance.objects.count()
    pages = max(1, -(-count // INSTANCES_PAGE))
    page = min(max(1, page), pages)
    first = (page - 1) * INSTANCES_PAGE
    instances = list(ModelInstance.objects.select_related("node")[first:first + INSTANCES_PAGE])
    desired = dict(ModelDeployment.objects.filter(model_name__in={i.model_name for i in instances})
                   .values_list("model_name", "replicas"))
    for inst in instances:  # the scale control's value, one query for the page
        inst._replicas_desired = desired.get(inst.model_name)
    active = ModelInstance.objects.filter(state__in=ACTIVE_STATES)
    return {
        "instances": instances, "can_operate": can_operate,
        "ready": active.filter(state=InstanceState.READY).count(), "total": active.count(),
        "list_version": max((i.live_version for i in instances), default=0),
        "page": page, "pages": pages, "count": count, "first": first + 1 if instances else 0,
        "last": first + len(instances), "card_id": "instances-card" if page == 1 else f"instances-card-p{page}",
    }


