"""A team's GPU-seconds budget per UTC month (issue 26), as the proxy's admission checks it: the
figure is chargeback's by team (the one the team page and the chargeback API show), read from the
usage buckets and READY history and kept per process between reads, so a request costs no query.
The GPU-seconds come as chargeback's own tests make them: busy seconds on an instance of known GPUs
(here one without READY history, whose busy seconds count whole: GPUs x busy)."""
from __future__ import annotations

import dataclasses
import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from accounts.credentials import Principal
from serving.proxy.chargeback import chargeback
from serving.proxy.errors import ProxyError
from serving.proxy.gpu_budget import CODE, GpuBudgets

pytestmark = pytest.mark.django_db(transaction=True)


def team_principal(team, **extra) -> Principal:
    return Principal(user_id=0, username=f"team:{team.slug}", role="viewer", key_id=-team.pk, key_name=team.name,
                     scopes=frozenset(), gpu_seconds_month=team.gpu_seconds_month, **extra)


async def _setup(budget: int | None):
    """A team (with `budget`), one key of it, and a stopped 2-GPU instance its usage names."""
    from django.utils import timezone

    from accounts.models import ApiKey, Team, User
    from hardware.models import Node
    from serving.models import ModelInstance

    tag = uuid.uuid4().hex[:6]
    user = await User.objects.acreate(username=f"u{tag}")
    team = await Team.objects.acreate(name=f"Team {tag}", slug=f"t{tag}", gpu_seconds_month=budget)
    key = await ApiKey.objects.acreate(user=user, name=f"k{tag}", prefix="p", key_hash=uuid.uuid4().hex, team=team)
    node = await Node.objects.acreate(name=f"n{tag}", address="127.0.0.1", last_heartbeat=timezone.now())
    instance = await ModelInstance.objects.acreate(model_name=f"m{tag}", model_path="/m", backend="b", node=node,
                                                   gpus=[0, 1], state="STOPPED")
    return team, key, instance


async def _busy(key, instance, seconds: float) -> None:
    """`seconds` more busy time of `key` on `instance` this hour (as the usage recorder writes it)."""
    from serving.models import UsageBucket

    hour = datetime.now(tz=UTC).replace(minute=0, second=0, microsecond=0)
    row, _ = await UsageBucket.objects.aget_or_create(
        bucket_start=hour, key_id=key.pk, key_name=key.name, username="u", model=instance.model_name,
        instance_id=instance.pk, node="n", team_id=key.team_id)
    row.busy_seconds += seconds
    row.requests += 1
    await row.asave()


def _team_figure(team_id: int) -> float:
    now = datetime.now(tz=UTC)
    out = chargeback(start=now.replace(day=1, hour=0, minute=0, second=0, microsecond=0), end=now,
                     group_by="team")
    return next(i["gpu_seconds"] for i in out["items"] if i["team_id"] == team_id)


async def test_a_team_is_refused_once_its_chargeback_figure_reaches_the_budget(settings):
    from asgiref.sync import sync_to_async

    settings.TEAM_GPU_BUDGET_REFRESH_S = 300  # no background re-read in this test: it reads when it says
    team, key, instance = await _setup(budget=100)
    budgets = GpuBudgets()
    t = team_principal(team)
    await _busy(key, instance, 30)  # 2 GPUs x 30 s = 60 GPU-seconds
    await budgets.check(t)  # the first check reads: 60 < 100
    await _busy(key, instance, 25)  # 110 now
    await budgets.check(t)  # the figure in hand (60) until the next read: no query per request
    await budgets.refresh()
    with pytest.raises(ProxyError) as refused:
        await budgets.check(t)
    figure = await sync_to_async(_team_figure)(team.pk)
    assert figure == 110.0  # what the chargeback API and the team page show
    err = refused.value
    assert err.status == 429 and json.loads(err.body()) == {"error": {
        "type": "rate_limit_error", "code": CODE,
        "message": f"The team '{team.name}' has used its GPU-seconds budget for this month: 110.0 of 100 "
                   f"GPU-seconds (all its keys together); it renews in {err.message.rsplit(' ', 1)[1]}"}}
    assert CODE == "team_gpu_budget_exhausted"
    now = datetime.now(tz=UTC)
    month_end = (now.replace(year=now.year + 1, month=1) if now.month == 12 else now.replace(month=now.month + 1)
                 ).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    retry = int(dict(err.headers)[b"retry-after"])
    assert abs(retry - (month_end - now).total_seconds()) < 60  # to the month's end
    # A larger budget (the key cache brings the team's new one) lets it through on the same figure.
    await budgets.check(dataclasses.replace(t, gpu_seconds_month=1000))


async def test_a_team_without_a_budget_or_under_it_is_not_refused(settings):
    settings.TEAM_GPU_BUDGET_REFRESH_S = 300
    rich, rich_key, inst = await _setup(budget=None)
    small, small_key, inst2 = await _setup(budget=10)
    await _busy(rich_key, inst, 500)  # 1,000 GPU-seconds: no budget, nothing refused
    await _busy(small_key, inst2, 2)  # 4 of 10
    budgets = GpuBudgets()
    await budgets.check(team_principal(rich))
    await budgets.check(team_principal(small))
    await _busy(small_key, inst2, 3)  # 10 of 10: the budget is reached
    await budgets.refresh()
    with pytest.raises(ProxyError):
        await budgets.check(team_principal(small))
    await budgets.check(team_principal(rich))


async def test_the_figures_are_read_again_in_the_background_when_stale(settings):
    settings.TEAM_GPU_BUDGET_REFRESH_S = 0  # every check finds them stale
    team, key, instance = await _setup(budget=50)
    budgets = GpuBudgets()
    t = team_principal(team)
    await budgets.check(t)  # read: 0
    await _busy(key, instance, 30)  # 60 GPU-seconds
    await budgets.check(t)  # passes with the figure in hand, starts a read
    await budgets.refresh()  # (waits for that read)
    with pytest.raises(ProxyError):
        await budgets.check(t)


async def test_the_settled_hours_and_the_recent_ones_add_up_to_chargebacks_figure():
    """A read sums the hours that ended over an hour ago (kept between reads) and the recent ones:
    the same figure as chargeback by team over the whole month, READY time split by hour included."""
    import math
    import time

    from asgiref.sync import sync_to_async

    from serving.models import InstanceEvent, UsageBucket
    from serving.proxy.gpu_budget import read_team_gpu_seconds

    team, key, instance = await _setup(budget=10**6)
    now = datetime.now(tz=UTC)
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    earlier = max(month, now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=3))
    # READY from the month's start: the busy seconds of each hour are charged in full, and shared
    # with another key's in the hour they meet.
    await InstanceEvent.objects.acreate(instance=instance, at=month, to_state="READY")
    other_team, other_key, _ = await _setup(budget=None)
    for hour, k, busy in ((earlier, key, 100), (earlier, other_key, 50)):
        await UsageBucket.objects.acreate(bucket_start=hour, key_id=k.pk, key_name=k.name, username="u",
                                          model=instance.model_name, instance_id=instance.pk, node="n",
                                          busy_seconds=busy, team_id=k.team_id)
    await _busy(key, instance, 10)  # this hour
    figures, settled = await sync_to_async(read_team_gpu_seconds)(time.time())
    for t in (team, other_team):
        assert figures[t.pk] == pytest.approx(await sync_to_async(_team_figure)(t.pk), abs=0.002)
    assert figures[team.pk] == pytest.approx(2 * 110, abs=0.002)
    # A late row in a settled hour (a journal replayed) counts once the settled part is read again.
    if earlier < now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=1):
        await UsageBucket.objects.acreate(bucket_start=earlier, key_id=key.pk, key_name=key.name, username="late",
                                          model=instance.model_name, instance_id=instance.pk, node="n",
                                          busy_seconds=40, team_id=key.team_id)
        again, _ = await sync_to_async(read_team_gpu_seconds)(time.time(), settled)
        assert again[team.pk] == pytest.approx(figures[team.pk], abs=0.002)  # kept from the last read
        stale = dataclasses.replace(settled, read_at=-math.inf)
        again, _ = await sync_to_async(read_team_gpu_seconds)(time.time(), stale)
        assert again[team.pk] == pytest.approx(await sync_to_async(_team_figure)(team.pk), abs=0.002)
        assert again[team.pk] == pytest.approx(2 * 150, abs=0.002)
