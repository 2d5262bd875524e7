"""A team's limits in the rate limiter, local and Redis (cluster mode: the same Lua script, the
team's counters under its own keys): two keys of one team share the team's quota and the team's
rpm, a key of another team does not, and a team quota starts from the usage every key of the team
already wrote."""
from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from accounts.credentials import Principal
from serving.proxy.limits import RedisLimiter
from tests.serving.test_limits import Clock, make  # noqa: F401  (the local/redis fixture)


def team(team_id: int, **limits) -> Principal:
    return Principal(user_id=0, username="team:t", role="viewer", key_id=-team_id, key_name="Team T",
                     scopes=frozenset(), **limits)


def key(key_id: int, t: Principal | None) -> Principal:
    return Principal(user_id=1, username="u", role="viewer", key_id=key_id, key_name=f"k{key_id}", team=t)


@pytest.mark.django_db(transaction=True)
async def test_two_keys_share_their_teams_daily_quota(make):  # noqa: F811
    from accounts.models import Team

    t_row = await Team.objects.acreate(name=f"t{uuid.uuid4().hex[:6]}", slug=f"t{uuid.uuid4().hex[:6]}")
    clock = Clock()
    limiter = make(clock)
    t = team(t_row.pk, daily_tokens=100)
    a, b = key(900_001, t), key(900_002, t)
    assert (await limiter.admit(t)).allowed
    limiter.charge(a, 60)  # the key has no limits of its own: the charge goes to its team
    limiter.charge(b, 60)
    if isinstance(limiter, RedisLimiter):
        await limiter.flush()
    refused = await limiter.admit(t)
    assert not refused.allowed and refused.code == "insufficient_quota"
    assert "team 'Team T'" in refused.message(t)
    other = team(t_row.pk + 1000, daily_tokens=100)
    assert (await limiter.admit(other)).allowed  # another team's counters are its own


@pytest.mark.django_db(transaction=True)
async def test_a_team_quota_starts_from_what_its_keys_wrote(make):  # noqa: F811
    from accounts.models import ApiKey, Team, User
    from serving.models import UsageBucket

    user = await User.objects.acreate(username=f"u{uuid.uuid4().hex[:6]}")
    t_row = await Team.objects.acreate(name=f"t{uuid.uuid4().hex[:6]}", slug=f"t{uuid.uuid4().hex[:6]}")
    k1 = await ApiKey.objects.acreate(user=user, name="a", prefix="a", key_hash=uuid.uuid4().hex, team=t_row)
    k2 = await ApiKey.objects.acreate(user=user, name="b", prefix="b", key_hash=uuid.uuid4().hex, team=t_row)
    clock = Clock()
    hour = datetime.fromtimestamp(clock.now // 3600 * 3600 - 86400, tz=UTC)  # yesterday, this month
    for k, used in ((k1, 500), (k2, 499)):
        await UsageBucket.objects.acreate(bucket_start=hour, key_id=k.pk, model="m", prompt_tokens=used,
                                          team_id=t_row.pk, team_slug=t_row.slug)
    # What k1 used before it joined the team (no team then) is not the team's.
    await UsageBucket.objects.acreate(bucket_start=hour, key_id=k1.pk, model="m", prompt_tokens=5000)
    limiter = make(clock)
    t = team(t_row.pk, monthly_tokens=1000)
    assert (await limiter.admit(t)).allowed  # 999 used by the two keys
    limiter.charge(key(k1.pk, t), 1)
    if isinstance(limiter, RedisLimiter):
        await limiter.flush()
    assert not (await limiter.admit(t)).allowed


async def test_a_teams_rpm_counts_requests_of_all_its_keys(make):  # noqa: F811
    clock = Clock()
    limiter = make(clock)
    t = team(int(uuid.uuid4().int % 10**6) + 5000, rpm=2)
    assert (await limiter.admit(t)).allowed  # key a's request
    assert (await limiter.admit(t)).allowed  # key b's
    third = await limiter.admit(t)
    assert not third.allowed and third.code == "rate_limit_exceeded"
    assert "Rate limit reached for the team 'Team T' (2 requests per minute" in third.message(t)
