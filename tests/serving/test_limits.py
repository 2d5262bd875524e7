"""The rate limiter's rule (GCRA buckets a minute deep, token quotas per UTC day and month), the
same scenarios against the in-process limiter and against the Redis one (real Redis on loopback,
the Lua script), on a clock the test moves."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from accounts.credentials import Principal
from serving.proxy.limits import KeyState, LocalLimiter, RedisLimiter, _duration, decide

REDIS = "redis://127.0.0.1:6379/14"


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0  # 2027-01-15 08:00 UTC

    def __call__(self) -> float:
        return self.now


def key(**limits) -> Principal:
    return Principal(user_id=1, username="u", role="viewer", key_id=limits.pop("key_id", 7), key_name="k", **limits)


@pytest.fixture(params=["local", "redis"])
async def make(request) -> AsyncIterator:
    made = []

    def factory(clock: Clock):
        if request.param == "local":
            limiter = LocalLimiter(clock=clock)
        else:
            limiter = RedisLimiter(REDIS, prefix=f"xgen-test:{uuid.uuid4().hex[:8]}", clock=clock)
        made.append(limiter)
        return limiter

    yield factory
    for limiter in made:
        await limiter.close()


def header(verdict, name: str) -> str | None:
    return dict(verdict.headers).get(name.encode(), b"").decode() or None


async def test_rpm_3_the_fourth_request_waits_for_one_to_drain(make):
    clock = Clock()
    limiter = make(clock)
    p = key(rpm=3)
    seen = [await limiter.admit(p) for _ in range(3)]
    assert all(v.allowed for v in seen)
    assert [header(v, "x-ratelimit-remaining-requests") for v in seen] == ["2", "1", "0"]
    assert header(seen[0], "x-ratelimit-limit-requests") == "3"
    assert header(seen[2], "x-ratelimit-reset-requests") == "1m0s"
    fourth = await limiter.admit(p)
    assert not fourth.allowed and fourth.code == "rate_limit_exceeded"
    assert fourth.retry_after_s == pytest.approx(20, abs=0.01)
    assert header(fourth, "retry-after") == "20" and header(fourth, "x-ratelimit-remaining-requests") == "0"
    clock.now += 19.9
    assert not (await limiter.admit(p)).allowed  # refused requests do not count
    clock.now += 0.1
    again = await limiter.admit(p)
    assert again.allowed and header(again, "x-ratelimit-remaining-requests") == "0"
    clock.now += 60
    assert header(await limiter.admit(p, cost=0), "x-ratelimit-remaining-requests") == "3"  # a peek counts nothing


async def test_tpm_admits_until_the_bucket_is_empty_then_waits_out_the_debt(make):
    clock = Clock()
    limiter = make(clock)
    p = key(tpm=600)
    first = await limiter.admit(p)
    assert first.allowed and header(first, "x-ratelimit-remaining-tokens") == "600"
    limiter.charge(p, 900)  # a big answer: 300 tokens of debt, i.e. 30 s at 10 tokens/s
    if isinstance(limiter, RedisLimiter):
        await limiter.flush()
    refused = await limiter.admit(p)
    assert not refused.allowed and refused.code == "rate_limit_exceeded"
    assert refused.retry_after_s == pytest.approx(30.1, abs=0.01)  # until one token is back
    assert header(refused, "x-ratelimit-remaining-tokens") == "0"
    assert header(refused, "x-ratelimit-reset-tokens") == "1m30s"
    clock.now += 30.1
    ok = await limiter.admit(p)
    assert ok.allowed and header(ok, "x-ratelimit-remaining-tokens") == "1"


@pytest.mark.django_db(transaction=True)
async def test_a_daily_quota_refuses_with_insufficient_quota_until_the_day_ends(make):
    clock = Clock()
    limiter = make(clock)
    p = key(daily_tokens=100, key_id=int(uuid.uuid4().int % 10**6) + 1000)
    assert (await limiter.admit(p)).allowed
    limiter.charge(p, 60)
    assert (await limiter.admit(p)).allowed  # 60 < 100: in (a request may end past the quota)
    limiter.charge(p, 60)
    refused = await limiter.admit(p)
    assert not refused.allowed and refused.code == "insufficient_quota"
    assert refused.retry_after_s == pytest.approx(16 * 3600, abs=1)  # 08:00 UTC: 16 h to midnight
    assert header(refused, "retry-after") == str(16 * 3600)
    assert "x-ratelimit-limit-requests" not in dict((k.decode(), v) for k, v in refused.headers)
    clock.now += 16 * 3600
    assert (await limiter.admit(p)).allowed  # a new day starts from what the database holds for it: nothing


@pytest.mark.django_db(transaction=True)
async def test_a_quota_starts_from_the_usage_already_written(make):
    from datetime import UTC, datetime

    from serving.models import UsageBucket

    clock = Clock()
    p = key(monthly_tokens=1000, key_id=int(uuid.uuid4().int % 10**6) + 1000)
    hour = datetime.fromtimestamp(clock.now // 3600 * 3600 - 3 * 86400, tz=UTC)  # earlier this month
    await UsageBucket.objects.acreate(bucket_start=hour, key_id=p.key_id, model="m", prompt_tokens=600,
                                      completion_tokens=399)
    limiter = make(clock)
    assert (await limiter.admit(p)).allowed  # 999 used
    limiter.charge(p, 1)
    if isinstance(limiter, RedisLimiter):
        await limiter.flush()
    refused = await limiter.admit(p)
    assert not refused.allowed and refused.code == "insufficient_quota"


def test_the_reset_format_is_openais():
    assert [_duration(ms) for ms in (0, 20, 999.2, 1000, 17_500, 59_999, 60_000, 360_000, 3_723_000)] == [
        "0ms", "20ms", "1000ms", "1s", "17.5s", "59.999s", "1m0s", "6m0s", "1h2m3s"]


def test_decide_is_one_rule_for_requests_tokens_and_quotas_together():
    state = KeyState(day="x", day_used=0)
    args = dict(rpm=60, tpm=1000, day_quota=50, month_quota=0, day_left_ms=5000, month_left_ms=0)
    assert decide(state, now_ms=0, cost=1, charge=0, **args)[0] == 1
    decide(state, now_ms=10, cost=0, charge=50, **args)
    allowed, code, retry, r_rem, _, t_rem, _ = decide(state, now_ms=20, cost=1, charge=0, **args)
    # Over the quota: that answer wins (waiting a minute would not help); the request was not counted.
    assert (allowed, code, retry, r_rem) == (0, "insufficient_quota", 5000, 59) and t_rem == 950


async def test_a_redis_that_cannot_be_reached_lets_requests_through_and_keeps_the_charges():
    limiter = RedisLimiter("redis://127.0.0.1:1/0", clock=Clock())
    try:
        p = key(rpm=1)
        assert (await limiter.admit(p)).allowed and (await limiter.admit(p)).allowed
        limiter.charge(key(tpm=10), 5)
        limiter._down_until = 0.0
        await limiter.flush()
        assert limiter._pending[7][1] == 5  # kept for when Redis is back
        assert limiter._down_until > 0  # and for a second no request asks Redis again
    finally:
        await limiter.close()
