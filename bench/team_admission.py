"""What a key's team costs on the proxy's hot path: CPU per admission (serving.proxy.admission's
limiter calls for one request) for a key with a daily quota and rpm alone, and for the same key in a
team with a daily quota and rpm, on the in-process limiter (the embedded default), in interleaved
rounds of the same run. No database: both quotas are seeded once before the rounds, as the first
request of a day does. The Redis limiter adds one script call (a round trip) per request for the
team, measured with --redis.

    python bench/team_admission.py [--requests N] [--rounds R] [--redis URL]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
_data = tempfile.mkdtemp(prefix="xgen-bench-team-")
os.environ.setdefault("XGEN_DATA_DIR", _data)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "xgenconsole.settings")

import django  # noqa: E402

django.setup()

from accounts.credentials import Principal  # noqa: E402
from serving.proxy.limits import LocalLimiter, RedisLimiter, _periods  # noqa: E402

TEAM = Principal(user_id=0, username="team:t", role="viewer", key_id=-1, key_name="T", rpm=10**9,
                 daily_tokens=10**15, scopes=frozenset())
ALONE = Principal(user_id=1, username="u", role="viewer", key_id=1, key_name="k", rpm=10**9, daily_tokens=10**15)
IN_TEAM = Principal(user_id=1, username="u", role="viewer", key_id=2, key_name="k", rpm=10**9,
                    daily_tokens=10**15, team=TEAM)


async def admit(limiter, p: Principal) -> None:
    """What admit_request asks of the limiter for one request, and what the answer's end charges."""
    if p.team is not None and p.team.limited:
        await limiter.admit(p.team)
    await limiter.admit(p)
    limiter.charge(p, 10)


async def round_of(limiter, p: Principal, n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        await admit(limiter, p)
    return (time.process_time() - start) / n * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--redis", default="")
    args = parser.parse_args()
    limiter = RedisLimiter(args.redis, prefix=f"xgen-bench:{os.getpid()}") if args.redis else LocalLimiter()
    day = _periods(time.time())[0]
    for p in (TEAM, ALONE, IN_TEAM):  # seeded as the day's first request would (no database in the rounds)
        limiter._seeds[(p.key_id, day)] = (0, time.monotonic())
    n = args.requests // (50 if args.redis else 1)
    for p in (ALONE, IN_TEAM):
        await round_of(limiter, p, max(1, n // 10))  # warm up
    alone, team = [], []
    for _ in range(args.rounds):
        alone.append(await round_of(limiter, ALONE, n))
        team.append(await round_of(limiter, IN_TEAM, n))
    await limiter.close()
    a, t = statistics.median(alone), statistics.median(team)
    kind = "Redis" if args.redis else "in-process"
    print(f"{kind} limiter, {n} requests x {args.rounds} rounds, CPU per request (median of rounds):")
    print(f"  key alone (rpm + daily quota):        {a:8.2f} us")
    print(f"  key in a team (both rpm + quota):     {t:8.2f} us  ({t / a:.2f}x, +{t - a:.2f} us)")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(_data, ignore_errors=True)
