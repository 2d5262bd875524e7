"""Websocket consumers of the instance pages (the shared LiveConsumer does the work)."""
from __future__ import annotations

from live.consumers import LiveConsumer
from serving.events import LIST_GROUP, instance_group


class InstancesConsumer(LiveConsumer):
    """/ws/instances/: every instance's row on the list page."""

    def groups_for(self) -> list[str]:
        return [LIST_GROUP]


class InstanceConsumer(LiveConsumer):
    """/ws/instances/<id>/: one instance's state, timeline and log lines."""

    def groups_for(self) -> list[str]:
        return [instance_group(int(self.scope["url_route"]["kwargs"]["pk"]))]
