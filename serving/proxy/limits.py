"""Per-key rate limits and token quotas, enforced by the proxy in every web process together.

One interface, two implementations: `LocalLimiter` keeps the state in this process (the embedded
default: one web process), `RedisLimiter` keeps it in Redis when REDIS_URL is set (cluster mode),
checked and updated by one Lua script: one round trip per request, atomic across processes.

Requests per minute and tokens per minute are GCRA buckets (a generic cell rate: one timestamp
per bucket, the "theoretical arrival time"), a minute deep: `rpm` requests may come at once,
then one every 60/rpm s. Tokens are known only when the answer's `usage` arrives, so a request
is admitted while the token bucket is not empty and its tokens are charged afterwards (it may go
into debt, which later requests wait out). Charges are not a round trip of their own: they ride
on the key's next admission, or a background flush (every CHARGE_FLUSH_S) sends them.
Daily and monthly quotas count prompt + completion tokens per UTC day and month, starting from
the usage buckets in the database (so a restart, or a Redis that lost its data, starts from what
was written, not from zero).

Teams (issue 26): a key's team has the same limits, counted over every key of the team: the team is
a principal of its own (key id -team id, accounts.credentials.principal_for_team) cached inside the
key's, admitted before the key and charged with it; its quotas start from the usage of all its keys.

Over rpm/tpm: 429 `rate_limit_exceeded`; over a quota: 429 `insufficient_quota`; both with
Retry-After. Every answer to a key with rpm or tpm carries OpenAI's x-ratelimit-* headers.
A limiter that fails (Redis down) lets requests through and says so in the log.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from django.conf import settings

from accounts.credentials import Principal
from live.db import run_db
from live.tasks import cancel_and_wait

log = logging.getLogger("xgen.proxy")

WINDOW_MS = 60_000
CHARGE_FLUSH_S = 0.5
REDIS_RETRY_S = 1.0  # after Redis failed, requests pass without asking it for this long
SEED_REFRESH_S = 60.0  # Redis only: how old a quota's starting point may get before it is re-read


@dataclass
class Verdict:
    allowed: bool = True
    code: str | None = None  # rate_limit_exceeded | insufficient_quota
    retry_after_s: float = 0.0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    def message(self, p: Principal) -> str:
        if p.key_id < 0:  # a team's limits (accounts.credentials.principal_for_team)
            if self.code == "insufficient_quota":
                return (f"The team '{p.key_name}' has used its token quota (all its keys together); it renews in "
                        f"{_duration(self.retry_after_s * 1000)}.")
            return (f"Rate limit reached for the team '{p.key_name}' ({_limits_text(p)}, all its keys together); "
                    f"try again in {_duration(self.retry_after_s * 1000)}.")
        if self.code == "insufficient_quota":
            return (f"This key has used its token quota; it renews in {_duration(self.retry_after_s * 1000)}.")
        return (f"Rate limit reached for this key ({_limits_text(p)}); try again in "
                f"{_duration(self.retry_after_s * 1000)}.")


def _limits_text(p: Principal) -> str:
    parts = []
    if p.rpm:
        parts.append(f"{p.rpm} requests per minute")
    if p.tpm:
        parts.append(f"{p.tpm} tokens per minute")
    return ", ".join(parts) or "its limits"


def _duration(ms: float) -> str:
    """OpenAI's reset format: 20ms, 1s, 17.5s, 6m0s, 1h2m3s."""
    ms = max(0.0, ms)
    if ms < 1000:
        return f"{int(math.ceil(ms))}ms"
    s = ms / 1000
    if s < 60:
        return f"{round(s, 3):g}s"
    h, rest = divmod(int(round(s)), 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m}m{sec}s" if h else f"{m}m{sec}s"


_period_cache: list = [0.0, 0.0, "", 0.0, ""]  # valid from, day end, day id, month end, month id (epoch s)


def _periods(now_s: float) -> tuple[str, float, str, float]:
    """(day id, ms left in the UTC day, month id, ms left in the UTC month); on every request, so
    the day's boundaries are worked out once a day."""
    since, day_end, day_id, month_end, month_id = _period_cache
    if not since <= now_s < day_end:
        now = datetime.fromtimestamp(now_s, tz=UTC)
        day_start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        month_start = day_start.replace(day=1)
        next_month = (month_start.replace(year=month_start.year + 1, month=1) if month_start.month == 12
                      else month_start.replace(month=month_start.month + 1))
        since, day_end, month_end = day_start.timestamp(), day_start.timestamp() + 86_400, next_month.timestamp()
        day_id, month_id = day_start.strftime("%Y%m%d"), month_start.strftime("%Y%m")
        _period_cache[:] = [since, day_end, day_id, month_end, month_id]
    return day_id, (day_end - now_s) * 1000, month_id, (month_end - now_s) * 1000


def period_starts(now_s: float) -> tuple[datetime, datetime]:
    now = datetime.fromtimestamp(now_s, tz=UTC)
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    return day, day.replace(day=1)


def _headers(p: Principal, r_rem: int, r_reset: float, t_rem: int, t_reset: float) -> list[tuple[bytes, bytes]]:
    out = []
    if p.rpm:
        out += [(b"x-ratelimit-limit-requests", str(p.rpm).encode()),
                (b"x-ratelimit-remaining-requests", str(max(0, r_rem)).encode()),
                (b"x-ratelimit-reset-requests", _duration(r_reset).encode())]
    if p.tpm:
        out += [(b"x-ratelimit-limit-tokens", str(p.tpm).encode()),
                (b"x-ratelimit-remaining-tokens", str(max(0, t_rem)).encode()),
                (b"x-ratelimit-reset-tokens", _duration(t_reset).encode())]
    return out


def _verdict(p: Principal, raw: list) -> Verdict:
    allowed, code, retry_ms, r_rem, r_reset, t_rem, t_reset = raw
    code = code.decode() if isinstance(code, bytes) else code
    headers = _headers(p, int(r_rem), float(r_reset), int(t_rem), float(t_reset))
    verdict = Verdict(allowed=bool(int(allowed)), code=code or None, retry_after_s=float(retry_ms) / 1000,
                      headers=headers)
    if not verdict.allowed:
        seconds = max(1, math.ceil(verdict.retry_after_s))
        verdict.headers = headers + [(b"retry-after", str(seconds).encode()),
                                     (b"retry-after-ms", str(max(1, int(math.ceil(float(retry_ms))))).encode())]
    return verdict


@dataclass
class KeyState:
    """One key's buckets and quota counters (the local limiter's state; Redis holds the same)."""

    tat_requests: float = 0.0  # ms
    tat_tokens: float = 0.0
    day: str = ""
    day_used: int = 0
    month: str = ""
    month_used: int = 0


def decide(state: KeyState, *, now_ms: float, rpm: int, tpm: int, day_quota: int, month_quota: int,
           day_left_ms: float, month_left_ms: float, cost: int, charge: int) -> list:
    """The limiter's rule, on one key's state (the Lua script below is the same, line for line):
    apply `charge` tokens, then admit a request of `cost` (0: only read the state).
    Returns [allowed, code, retry_ms, requests left, requests reset ms, tokens left, tokens reset ms]."""
    w = WINDOW_MS
    ttok = max(state.tat_tokens, now_ms) if tpm > 0 else 0.0
    if charge > 0:
        if day_quota > 0:
            state.day_used += charge
        if month_quota > 0:
            state.month_used += charge
        if tpm > 0:
            ttok += charge * w / tpm
            state.tat_tokens = ttok
    allowed, code, retry = 1, "", 0.0
    if day_quota > 0 and state.day_used >= day_quota and cost > 0:
        allowed, code, retry = 0, "insufficient_quota", day_left_ms
    if month_quota > 0 and state.month_used >= month_quota and cost > 0:
        allowed, code, retry = 0, "insufficient_quota", max(retry, month_left_ms)
    t_rem, t_reset = -1, 0.0
    if tpm > 0:
        debt = ttok - now_ms
        t_rem, t_reset = max(0, math.floor((w - debt) * tpm / w)), max(0.0, debt)
        if cost > 0 and t_rem < 1:  # not one token left
            if allowed:
                code = "rate_limit_exceeded"
            allowed, retry = 0, max(retry, debt - w + w / tpm)
    r_rem, r_reset = -1, 0.0
    if rpm > 0:
        step = w / rpm
        tat = max(state.tat_requests, now_ms)
        new = tat + step * cost
        if new - now_ms > w + 0.5:
            if allowed:
                code = "rate_limit_exceeded"
            allowed, retry = 0, max(retry, new - now_ms - w)
        if allowed:
            if cost > 0:
                state.tat_requests = new
            tat = new
        r_rem, r_reset = math.floor((w - (tat - now_ms)) / step + 1e-9), tat - now_ms
    return [allowed, code, math.ceil(retry), r_rem, math.ceil(r_reset), t_rem, math.ceil(t_reset)]


def _who(p: Principal) -> str:
    return f"team {p.key_name!r}" if p.key_id < 0 else f"key {p.key_id}"


class RateLimiter:
    """admit() before a request is forwarded; charge() when its tokens are known (no I/O), to the
    key and to its team. A team is a principal of key id -team id (its counters are keyed apart)."""

    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self._seeds: dict[tuple[int, str], tuple[int, float]] = {}  # (key, period) -> (tokens, read at)

    async def admit(self, p: Principal, *, cost: int = 1) -> Verdict:
        raise NotImplementedError

    def charge(self, p: Principal, tokens: int) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        return None

    async def _seed(self, p: Principal, period: str, since: datetime, *, refresh: bool) -> int | None:
        """The tokens a key had used in `period` by the last write (plus this process's unwritten);
        None when the database cannot say (the quota is not checked then: fail open, like Redis)."""
        from serving.proxy.usage import recorder, tokens_used

        cached = self._seeds.get((p.key_id, period))
        if cached is not None and not (refresh and time.monotonic() - cached[1] > SEED_REFRESH_S):
            return cached[0]
        if cached is not None:  # Redis: refresh in the background, serve the old value meanwhile
            asyncio.get_running_loop().create_task(self._reseed(p, period, since))
            return cached[0]
        try:
            used = await run_db(tokens_used, p.key_id, since)
        except Exception as exc:
            log.warning("token quota of %s not checked: its usage could not be read (%s)", _who(p), exc)
            return None
        used += recorder.pending_tokens(p.key_id, since.timestamp())
        self._seeds[(p.key_id, period)] = (used, time.monotonic())
        return used

    async def _reseed(self, p: Principal, period: str, since: datetime) -> None:
        from serving.proxy.usage import recorder, tokens_used

        self._seeds[(p.key_id, period)] = (self._seeds[(p.key_id, period)][0], time.monotonic())
        with contextlib.suppress(Exception):
            used = await run_db(tokens_used, p.key_id, since)
            used += recorder.pending_tokens(p.key_id, since.timestamp())
            self._seeds[(p.key_id, period)] = (used, time.monotonic())


class LocalLimiter(RateLimiter):
    """State in this process: right for the embedded default (one web process)."""

    def __init__(self, clock=time.time) -> None:
        super().__init__(clock)
        self._state: dict[int, KeyState] = {}

    async def admit(self, p: Principal, *, cost: int = 1) -> Verdict:
        now = self._clock()
        state = self._state.get(p.key_id)
        if state is None:
            state = self._state[p.key_id] = KeyState()
        day, day_left, month, month_left = _periods(now)
        if not p.daily_tokens:
            state.day = ""  # not counted meanwhile: a quota set later starts from the database
        if not p.monthly_tokens:
            state.month = ""
        if p.daily_tokens and state.day != day:
            seed = await self._seed(p, day, period_starts(now)[0], refresh=False)
            if seed is not None and state.day != day:
                state.day, state.day_used = day, seed
        if p.monthly_tokens and state.month != month:
            seed = await self._seed(p, month, period_starts(now)[1], refresh=False)
            if seed is not None and state.month != month:
                state.month, state.month_used = month, seed
        raw = decide(state, now_ms=now * 1000, rpm=p.rpm or 0, tpm=p.tpm or 0,
                     day_quota=(p.daily_tokens or 0) if state.day == day else 0,
                     month_quota=(p.monthly_tokens or 0) if state.month == month else 0,
                     day_left_ms=day_left, month_left_ms=month_left, cost=cost, charge=0)
        return _verdict(p, raw)

    def charge(self, p: Principal, tokens: int) -> None:
        if p.team is not None:
            self.charge(p.team, tokens)
        if tokens <= 0 or not (p.tpm or p.daily_tokens or p.monthly_tokens):
            return
        state = self._state.get(p.key_id)
        if state is None:
            state = self._state[p.key_id] = KeyState()
        day, _, month, _ = _periods(self._clock())
        # A counter of another period (or never seeded) starts again from the database at the next admission.
        decide(state, now_ms=self._clock() * 1000, rpm=0, tpm=p.tpm or 0,
               day_quota=(p.daily_tokens or 0) if state.day == day else 0,
               month_quota=(p.monthly_tokens or 0) if state.month == month else 0,
               day_left_ms=0, month_left_ms=0, cost=0, charge=tokens)


# The same rule as decide(), in Redis. KEYS: requests TAT, tokens TAT, day counter, month counter.
# ARGV: now_ms, rpm, tpm, day quota, month quota, day seed, month seed, day ms left, month ms left,
#       cost, charge.
LUA = """
local now = tonumber(ARGV[1])
local rpm, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
local dq, mq = tonumber(ARGV[4]), tonumber(ARGV[5])
local dleft, mleft = tonumber(ARGV[8]), tonumber(ARGV[9])
local cost, charge = tonumber(ARGV[10]), tonumber(ARGV[11])
local w = 60000
local function counter(key, quota, seed, left)
  if quota <= 0 then return 0 end
  local v = redis.call('GET', key)
  if not v then
    redis.call('SET', key, seed, 'PX', math.ceil(left) + 3600000)
    return tonumber(seed)
  end
  return tonumber(v)
end
local day = counter(KEYS[3], dq, ARGV[6], dleft)
local month = counter(KEYS[4], mq, ARGV[7], mleft)
local ttok = 0
if tpm > 0 then
  ttok = tonumber(redis.call('GET', KEYS[2]) or '0')
  if ttok < now then ttok = now end
end
if charge > 0 then
  if dq > 0 then day = redis.call('INCRBY', KEYS[3], charge) end
  if mq > 0 then month = redis.call('INCRBY', KEYS[4], charge) end
  if tpm > 0 then
    ttok = ttok + charge * w / tpm
    redis.call('SET', KEYS[2], string.format('%.3f', ttok), 'PX', math.ceil(ttok - now) + 1000)
  end
end
local allowed, code, retry = 1, '', 0
if dq > 0 and day >= dq and cost > 0 then allowed, code, retry = 0, 'insufficient_quota', dleft end
if mq > 0 and month >= mq and cost > 0 then allowed, code, retry = 0, 'insufficient_quota', math.max(retry, mleft) end
local trem, treset = -1, 0
if tpm > 0 then
  local debt = ttok - now
  trem = math.max(0, math.floor((w - debt) * tpm / w))
  treset = math.max(0, debt)
  if cost > 0 and trem < 1 then
    if allowed == 1 then code = 'rate_limit_exceeded' end
    allowed = 0
    retry = math.max(retry, debt - w + w / tpm)
  end
end
local rrem, rreset = -1, 0
if rpm > 0 then
  local step = w / rpm
  local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
  if tat < now then tat = now end
  local new = tat + step * cost
  if new - now > w + 0.5 then
    if allowed == 1 then code = 'rate_limit_exceeded' end
    allowed = 0
    retry = math.max(retry, new - now - w)
  end
  if allowed == 1 then
    if cost > 0 then redis.call('SET', KEYS[1], string.format('%.3f', new), 'PX', math.ceil(new - now) + 1000) end
    tat = new
  end
  rrem = math.floor((w - (tat - now)) / step + 1e-9)
  rreset = tat - now
end
return {allowed, code, tostring(math.ceil(retry)), rrem, tostring(math.ceil(rreset)), trem, tostring(math.ceil(treset))}
"""


class RedisLimiter(RateLimiter):
    """State in Redis, shared by every web process: one script call per admission."""

    def __init__(self, url: str, *, prefix: str = "xgen:rl", clock=time.time) -> None:
        super().__init__(clock)
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._script = self._redis.register_script(LUA)
        self._prefix = prefix
        self._pending: dict[int, tuple[Principal, int]] = {}
        self._flusher: asyncio.Task | None = None
        self._warned_at = 0.0
        self._down_until = 0.0

    def _keys(self, p: Principal, day: str, month: str) -> list[str]:
        base = f"{self._prefix}:{p.key_id}"
        return [f"{base}:r", f"{base}:t", f"{base}:d:{day}", f"{base}:m:{month}"]

    async def _args(self, p: Principal, now: float, cost: int, charge: int) -> tuple[list[str], list]:
        day, day_left, month, month_left = _periods(now)
        day_start, month_start = period_starts(now)
        day_seed = await self._seed(p, day, day_start, refresh=True) if p.daily_tokens else None
        month_seed = await self._seed(p, month, month_start, refresh=True) if p.monthly_tokens else None
        # A quota whose starting point is unknown is left out of this call (never seeded with 0).
        args = [f"{now * 1000:.3f}", p.rpm or 0, p.tpm or 0, p.daily_tokens if day_seed is not None else 0,
                p.monthly_tokens if month_seed is not None else 0, day_seed or 0, month_seed or 0,
                f"{day_left:.0f}", f"{month_left:.0f}", cost, charge]
        return self._keys(p, day, month), args

    async def admit(self, p: Principal, *, cost: int = 1) -> Verdict:
        self._ensure_flusher()
        if time.monotonic() < self._down_until:
            return Verdict()  # Redis failed just now: no request waits for its timeout again
        pending = self._pending.pop(p.key_id, None)
        charge = pending[1] if pending else 0
        try:
            keys, args = await self._args(p, self._clock(), cost, charge)
            raw = await self._script(keys=keys, args=args)
        except asyncio.CancelledError:
            if charge:
                self.charge(p, charge)
            raise
        except Exception as exc:
            if charge:
                self.charge(p, charge)
            self._warn(exc)
            return Verdict()  # fail open: a Redis restart must not stop inference
        return _verdict(p, raw)

    def charge(self, p: Principal, tokens: int) -> None:
        if p.team is not None:
            self.charge(p.team, tokens)
        if tokens <= 0 or not (p.tpm or p.daily_tokens or p.monthly_tokens):
            return
        _, before = self._pending.get(p.key_id, (p, 0))
        self._pending[p.key_id] = (p, before + tokens)

    def _ensure_flusher(self) -> None:
        task = self._flusher
        if task is None or task.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop(), name="limiter-charges")

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(CHARGE_FLUSH_S)
            await self.flush()

    async def flush(self) -> None:
        """Send the charges no admission has carried yet (one pipelined round trip)."""
        if not self._pending or time.monotonic() < self._down_until:
            return
        pending, self._pending = self._pending, {}
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for p, tokens in pending.values():
                    keys, args = await self._args(p, self._clock(), 0, tokens)
                    await self._script(keys=keys, args=args, client=pipe)
                await pipe.execute()
        except Exception as exc:
            for p, tokens in pending.values():
                self.charge(p, tokens)
            self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        self._down_until = time.monotonic() + REDIS_RETRY_S
        if time.monotonic() - self._warned_at > 10:
            self._warned_at = time.monotonic()
            log.warning("rate limiter: Redis failed (%s: %s); requests pass unlimited until it is back",
                        exc.__class__.__name__, exc)

    async def close(self) -> None:
        task, self._flusher = self._flusher, None
        await cancel_and_wait(task)
        with contextlib.suppress(Exception):
            await self.flush()
        with contextlib.suppress(Exception):
            await self._redis.aclose()


_limiter: RateLimiter | None = None
_limiter_loop: asyncio.AbstractEventLoop | None = None


def limiter() -> RateLimiter:
    """This process's limiter: Redis in cluster mode (REDIS_URL), else in-process."""
    global _limiter, _limiter_loop
    loop = asyncio.get_running_loop()
    if _limiter is None or (isinstance(_limiter, RedisLimiter) and _limiter_loop is not loop):
        _limiter_loop = loop
        url = getattr(settings, "REDIS_URL", None)
        _limiter = RedisLimiter(url) if url else LocalLimiter()
    return _limiter


async def shutdown_limiter() -> None:
    global _limiter
    if _limiter is not None:
        await _limiter.close()
    if isinstance(_limiter, RedisLimiter):
        _limiter = None
