"""Websocket consumers of the instance pages (the shared LiveConsumer does the work)."""
from __future__ import annotations

from urllib.parse import parse_qs

from history.samples import DEFAULT_RANGE, RANGES, dashboard_group
from live.consumers import LiveConsumer
from live.db import run_db
from serving.control.events import LIST_GROUP, instance_group


class InstancesConsumer(LiveConsumer):
    """/ws/instances/: every instance's row on the list page (?page=N: that page of it)."""

    def groups_for(self) -> list[str]:
        return [LIST_GROUP]

    def skipped_keys(self) -> frozenset[str]:
        # The pushed card is page 1; a later page follows its rows' state cells and the ready count.
        page = parse_qs(self.scope.get("query_string", b"").decode("latin-1")).get("page", ["1"])[0]
        later = len(page) <= 6 and page.isascii() and page.isdigit() and int(page) > 1
        return frozenset({"instances-card"}) if later else frozenset()


class InstanceConsumer(LiveConsumer):
    """/ws/instances/<id>/: one instance's state, timeline and log lines."""

    def groups_for(self) -> list[str]:
        return [instance_group(int(self.scope["url_route"]["kwargs"]["pk"]))]


class DashboardConsumer(LiveConsumer):
    """/ws/dashboard/<range>/: node panels, model charts, instance states and events. They are the
    whole fleet's: a team lead held to its teams (whose dashboard is its team's page) is refused (4403)."""

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is not None and user.is_authenticated and await run_db(user.team_scope) is not None:
            await self.close(code=4403)
            return
        await super().connect()

    def groups_for(self) -> list[str]:
        name = self.scope["url_route"]["kwargs"]["range"]
        return [dashboard_group(name if name in RANGES else DEFAULT_RANGE)]
