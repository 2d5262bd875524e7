"""Teams' GPU-seconds budgets (issue 26, `Team.gpu_seconds_month`), enforced by the proxy: once a
team's GPU-seconds this UTC month reach its budget, every inference request of its keys is refused
with 429 `team_gpu_budget_exhausted` and Retry-After to the month's end.

The figure is chargeback's by team (serving.proxy.chargeback: READY time x GPUs, split by busy
seconds), the one the team page and `/api/usage/chargeback?group_by=team` show, so a page and a
refusal agree. No request waits for the database for it: each process keeps every team's figure and
re-reads it in the background once it is TEAM_GPU_BUDGET_REFRESH_S old, when a request of a team
with a budget comes (only the first such request of a process, or of a new month, waits for the
read). A read covers the recent hours only: the hours that ended over an hour ago are kept and read
again every SETTLED_REFRESH_S, so a month of usage costs a read of two hours' rows, not the month's.
A team therefore runs past its budget by at most what it uses in the refresh interval plus the usage
flush (XGEN_USAGE_FLUSH: busy seconds reach the database in batches) and its requests in flight.
A read that fails (database down) lets requests through and says so in the log, as the limiter does.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from django.conf import settings

from accounts.credentials import Principal
from live.db import run_db
from serving.proxy.errors import ProxyError
from serving.proxy.limits import _duration, _periods, period_starts

log = logging.getLogger("xgen.proxy")

CODE = "team_gpu_budget_exhausted"


# Hours that ended this long ago are settled: usage for them has been written (each web process
# flushes within XGEN_USAGE_FLUSH), so they are read again only every SETTLED_REFRESH_S (a journal
# replayed late still counts then), and each refresh reads the recent hours only.
SETTLED_AFTER_S = 3600
SETTLED_REFRESH_S = 600.0


@dataclass
class Settled:
    """GPU-seconds per team over [month start, until): the part of the month that no longer changes."""

    month_start: datetime
    until: datetime
    read_at: float  # monotonic
    per_team: dict[int, float]  # team id -> GPU-seconds


def _per_team(start: datetime, end: datetime) -> dict[int, float]:
    from serving.proxy.chargeback import chargeback

    if end <= start:
        return {}
    return {i["team_id"]: i["gpu_seconds"] for i in chargeback(start=start, end=end, group_by="team")["items"]
            if i["team_id"]}


def read_team_gpu_seconds(now_s: float, settled: Settled | None = None) -> tuple[dict[int, float], Settled]:
    """Every team's GPU-seconds from the start of now's UTC month to now: chargeback by team (what
    its keys used while it owned them), summed from the settled hours (`settled`, read again when stale) and
    the recent ones. Returns the figures and the settled part to hand back next time."""
    month_start = period_starts(now_s)[1]
    cut = max(month_start, datetime.fromtimestamp((now_s // 3600) * 3600 - SETTLED_AFTER_S, tz=UTC))
    if (settled is None or settled.month_start != month_start or settled.until != cut
            or time.monotonic() - settled.read_at > SETTLED_REFRESH_S):
        settled = Settled(month_start=month_start, until=cut, read_at=time.monotonic(),
                          per_team=_per_team(month_start, cut))
    teams = dict(settled.per_team)
    for team_id, gs in _per_team(cut, datetime.fromtimestamp(now_s + 1, tz=UTC)).items():
        teams[team_id] = round(teams.get(team_id, 0.0) + gs, 6)
    return teams, settled


class GpuBudgets:
    """Teams' GPU-seconds this month, as this process last read them, and the check against a
    team's budget."""

    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self._used: dict[int, float] = {}
        self._month = ""  # the UTC month the figures are of ("": none read yet)
        self._read_at = -math.inf  # monotonic
        self._failed_at = -math.inf
        self._task: asyncio.Task | None = None
        self._settled: Settled | None = None

    async def check(self, team: Principal) -> None:
        """Raise ProxyError 429 when `team` (a team principal) has a budget and has used it."""
        budget = team.gpu_seconds_month
        if not budget:
            return
        now = self._clock()
        _, _, month, month_left_ms = _periods(now)
        stale = time.monotonic() - self._read_at >= settings.TEAM_GPU_BUDGET_REFRESH_S
        if self._month != month:
            if time.monotonic() - self._failed_at < settings.TEAM_GPU_BUDGET_REFRESH_S:
                return  # the last read failed just now: no request waits for another
            await self.refresh()  # the first in this process or month: waited for, once
            if self._month != month:
                return
        elif stale:
            self._refresh()  # in the background: this request goes on with the figure it has
        used = self._used.get(-team.key_id, 0.0)
        if used >= budget:
            seconds = max(1, math.ceil(month_left_ms / 1000))
            raise ProxyError(429, f"The team '{team.key_name}' has used its GPU-seconds budget for this month: "
                                  f"{used:.1f} of {budget} GPU-seconds (all its keys together); it renews in "
                                  f"{_duration(month_left_ms)}.", code=CODE,
                             headers=[(b"retry-after", str(seconds).encode())])

    async def refresh(self) -> None:
        """Read every team's figure now (or wait for the read in flight)."""
        await asyncio.shield(self._refresh())

    def _refresh(self) -> asyncio.Task:
        """The read in flight, or a new one (one at a time per process)."""
        task = self._task
        loop = asyncio.get_running_loop()
        if task is None or task.done() or task.get_loop() is not loop:
            task = self._task = loop.create_task(self._read(), name="team-gpu-budgets")
        return task

    async def _read(self) -> None:
        now = self._clock()
        try:
            used, self._settled = await run_db(read_team_gpu_seconds, now, self._settled)
        except Exception as exc:
            self._failed_at = time.monotonic()
            log.warning("teams' GPU-seconds budgets not checked: their use could not be read (%s)", exc)
            return
        self._used, self._month, self._read_at = used, _periods(now)[2], time.monotonic()

    def forget(self) -> None:
        """Drop what was read (the next check of a team with a budget reads again)."""
        self._used, self._month, self._read_at, self._failed_at = {}, "", -math.inf, -math.inf
        self._settled = None


budgets = GpuBudgets()
