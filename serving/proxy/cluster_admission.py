"""Cluster-wide admission (issue 25 #1): in cluster mode (REDIS_URL) a model's `max_concurrency`,
its queue (by priority, first come first served within one) and XGEN_QUEUE_MAX hold across every
web process, in Redis.

Per served name, three sorted sets under `<prefix>:<model>`:
- `:h` the slots held: a lease id -> its expiry (ms). A lease lives XGEN_ADMISSION_LEASE_S and is
  renewed while its request runs by one task per process (for all its leases and waiters, every
  third of the lease), so the slots of a web process killed with SIGKILL are free within the lease.
- `:q` the queue: a waiter id -> (100 - priority) * 1e12 + a sequence number (lowest first).
- `:e` each waiter's expiry (ms), renewed like a lease: a dead process's waiters leave the queue.
Every change runs one Lua script (atomic): drop what expired, then hand free slots to the head
of the queue and PUBLISH each id handed one on `<prefix>:grant`; every process listens there (one
subscription per process) and wakes its waiter. No request polls: a waiter sleeps on its future.
The renewal task also wakes a waiter whose grant message was lost (a reconnect) and hands on the
slots of a dead process when nothing else changed.

Redis failing: XGEN_ADMISSION_ON_REDIS_ERROR=local (default) falls back to this process's own
queue (serving.proxy.ondemand.ModelGate) with a log line, the counter
xgen_admission_redis_fallback_total and a banner on the dashboard; `refuse` answers 503
admission_unavailable. Redis is asked again REDIS_RETRY_S after a failure: cluster-wide again.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
import uuid

from django.conf import settings
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from live.tasks import cancel_and_wait
from serving.proxy import metrics
from serving.proxy.errors import ProxyError

log = logging.getLogger("xgen.proxy")

REDIS_RETRY_S = 1.0  # after Redis failed, requests use the fallback without asking it for this long
# A slot given back waits this long for the process's next acquire of the same model, which carries
# it in its own script call (one round trip a request instead of two); else it goes alone.
RELEASE_COALESCE_S = 0.002
PREFIX = "xgen:adm"

# KEYS: held, queue, waiter expiries. ARGV: now ms, lease ms, capacity (0: the one stored), the ids
# to remove (comma-separated, or ''), the id to enqueue (''), its score, XGEN_QUEUE_MAX, the grant channel, then ids to
# renew. Returns {status of the enqueued id (1 granted, 0 waits, -1 queue full, -2 none), queue
# length, ids among the renewed that hold a slot...}.
LUA = """
local now = tonumber(ARGV[1])
local lease = tonumber(ARGV[2])
local cap = tonumber(ARGV[3])
local capkey = KEYS[1] .. ':cap'
if cap > 0 then redis.call('SET', capkey, cap, 'PX', 86400000) else cap = tonumber(redis.call('GET', capkey) or '0') end
for id in string.gmatch(ARGV[4], '[^,]+') do
  redis.call('ZREM', KEYS[1], id); redis.call('ZREM', KEYS[2], id); redis.call('ZREM', KEYS[3], id)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)) do
  redis.call('ZREM', KEYS[2], id); redis.call('ZREM', KEYS[3], id)
end
local held = {}
for i = 9, #ARGV do
  local id = ARGV[i]
  if redis.call('ZSCORE', KEYS[1], id) then
    redis.call('ZADD', KEYS[1], now + lease, id); held[#held + 1] = id
  elseif redis.call('ZSCORE', KEYS[3], id) then
    redis.call('ZADD', KEYS[3], now + lease, id)
  end
end
local status = -2
local mine = ARGV[5]
if mine ~= '' then
  if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[7]) and redis.call('ZCARD', KEYS[1]) >= cap then
    return {-1, redis.call('ZCARD', KEYS[2])}
  end
  redis.call('ZADD', KEYS[2], tonumber(ARGV[6]), mine); redis.call('ZADD', KEYS[3], now + lease, mine)
  status = 0
end
while redis.call('ZCARD', KEYS[1]) < cap do
  local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not head then break end
  redis.call('ZREM', KEYS[2], head); redis.call('ZREM', KEYS[3], head)
  redis.call('ZADD', KEYS[1], now + lease, head)
  if head == mine then status = 1 else redis.call('PUBLISH', ARGV[8], KEYS[1] .. ' ' .. head) end
end
local out = {status, redis.call('ZCARD', KEYS[2])}
for _, id in ipairs(held) do out[#out + 1] = id end
return out
"""


class AdmissionUnavailable(Exception):
    """Redis could not be asked (the caller falls back or refuses)."""


def unavailable_error() -> ProxyError:
    return ProxyError(503, "Admission is unavailable: the console cannot reach Redis; try again in a moment.",
                      code="admission_unavailable", headers=[(b"retry-after", b"2")])


class ClusterAdmission:
    """This process's side of the shared queues (one per event loop)."""

    def __init__(self, url: str, *, prefix: str = PREFIX) -> None:
        import redis.asyncio as aioredis

        self.prefix = prefix
        self.channel = f"{prefix}:grant"
        self.proc = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._seq = itertools.count()
        self._redis = aioredis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._script = self._redis.register_script(LUA)
        self._held: dict[str, set[str]] = {}  # model key -> lease ids held here
        self._waiting: dict[str, dict[str, asyncio.Future]] = {}  # model key -> waiter id -> its future
        self._listener: asyncio.Task | None = None
        self._subscribed: asyncio.Event | None = None
        self._renewer: asyncio.Task | None = None
        self._releases: set[asyncio.Task] = set()
        self._to_release: dict[str, list[str]] = {}  # model key -> ids given back, not yet sent
        self._release_timers: dict[str, asyncio.TimerHandle] = {}
        self.down_until = 0.0
        self.down_since: float | None = None  # monotonic: when Redis failed (None: it works)
        self._warned_at = 0.0

    # -- the request path
    @staticmethod
    def lease_ms() -> int:
        return int(settings.ADMISSION_LEASE_S * 1000)

    def key(self, model: str) -> str:
        return f"{self.prefix}:{model}"

    def waiting(self, model: str) -> int:
        return len(self._waiting.get(self.key(model), ()))

    async def acquire(self, model: str, capacity: int, priority: int) -> tuple[str, str]:
        """Wait for a slot of `model` (capacity: the replicas' max_concurrency together); returns
        (model key, lease id). ProxyError 429 queue_full when the shared queue is full or the wait
        exceeds XGEN_QUEUE_TIMEOUT_S; AdmissionUnavailable when Redis fails."""
        if time.monotonic() < self.down_until:
            raise AdmissionUnavailable("Redis failed just now")
        key = self.key(model)
        wid = f"{self.proc}:{next(self._seq)}"
        score = (100 - max(0, min(priority, 99))) * 1e12 + time.time() * 1000
        try:
            await self._ensure_listening()
            fut = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(key, {})[wid] = fut
            raw = await self._run(key, capacity=capacity, remove=self._take_releases(key), enqueue=wid, score=score)
        except asyncio.CancelledError:
            self._forget_waiter(key, wid)
            self._release_later(key, wid)
            raise
        except Exception as exc:
            self._forget_waiter(key, wid)
            raise self._failed(exc) from exc
        status, depth = int(raw[0]), int(raw[1])
        if status == -1:
            self._forget_waiter(key, wid)
            metrics.QUEUE_REJECTED.labels(model).inc()
            raise ProxyError(429, f"The queue for '{model}' is full ({depth} requests wait across the cluster, "
                                  f"XGEN_QUEUE_MAX is {settings.QUEUE_MAX}); try again later.", code="queue_full",
                             headers=[(b"retry-after", b"1")])
        self._recovered()
        if status == 1 or fut.done():
            self._forget_waiter(key, wid)
            self._hold(key, wid)
            return key, wid
        self._ensure_renewer()
        metrics.QUEUE_DEPTH.labels(model).set(self.waiting(model))
        waited_from = time.perf_counter()
        try:
            async with asyncio.timeout(settings.QUEUE_TIMEOUT_S):
                await fut
            self._forget_waiter(key, wid)  # granted: no longer waiting (the depth below counts it out)
        except TimeoutError:
            self._forget_waiter(key, wid)
            self._release_later(key, wid)
            metrics.QUEUE_REJECTED.labels(model).inc()
            raise ProxyError(429, f"The queue for '{model}' is full (waited {settings.QUEUE_TIMEOUT_S} s, "
                                  "XGEN_QUEUE_TIMEOUT_S); try again later.", code="queue_full",
                             headers=[(b"retry-after", b"1")]) from None
        except AdmissionUnavailable:
            self._forget_waiter(key, wid)
            raise
        except asyncio.CancelledError:  # the client left (or was handed a slot as it left): give it on
            self._forget_waiter(key, wid)
            self._release_later(key, wid)
            raise
        finally:
            metrics.QUEUE_WAIT.labels(model).observe(time.perf_counter() - waited_from)
            metrics.QUEUE_DEPTH.labels(model).set(self.waiting(model))
        self._hold(key, wid)
        return key, wid

    def release(self, key: str, wid: str) -> None:
        """Give the slot back (off the request path: the answer is not held for it)."""
        held = self._held.get(key)
        if held is not None:
            held.discard(wid)
            if not held:
                del self._held[key]
        self._release_later(key, wid)

    # -- internals
    async def _run(self, key: str, *, capacity: int = 0, remove: str = "", enqueue: str = "", score: float = 0,
                   renew: list[str] | None = None) -> list:
        args = [int(time.time() * 1000), self.lease_ms(), capacity, remove, enqueue, f"{score:.0f}",
                settings.QUEUE_MAX, self.channel, *(renew or ())]
        try:  # EVALSHA straight (Script() would re-check its cache each call); the script on NOSCRIPT
            return await self._redis.evalsha(self._script.sha, 3, key, f"{key}:q", f"{key}:e", *args)
        except NoScriptError:
            return await self._script(keys=[key, f"{key}:q", f"{key}:e"], args=args)
        except RedisConnectionError:
            # A pooled connection that Redis (or the network) dropped, say after Redis came back:
            # drop every idle one at once and try once more on a fresh one (the script is idempotent).
            await self._redis.connection_pool.disconnect(inuse_connections=False)
            return await self._script(keys=[key, f"{key}:q", f"{key}:e"], args=args)

    def _hold(self, key: str, wid: str) -> None:
        self._held.setdefault(key, set()).add(wid)
        self._ensure_renewer()

    def _forget_waiter(self, key: str, wid: str) -> None:
        mine = self._waiting.get(key)
        if mine is not None:
            mine.pop(wid, None)
            if not mine:
                del self._waiting[key]

    def _release_later(self, key: str, wid: str) -> None:
        self._to_release.setdefault(key, []).append(wid)
        if key not in self._release_timers:
            self._release_timers[key] = asyncio.get_running_loop().call_later(
                RELEASE_COALESCE_S, self._send_releases, key)

    def _take_releases(self, key: str) -> str:
        """The ids of `key` given back and not sent yet (they go with the caller's script call)."""
        timer = self._release_timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        return ",".join(self._to_release.pop(key, ()))

    def _send_releases(self, key: str) -> None:
        ids = self._take_releases(key)
        if not ids:
            return

        async def release() -> None:
            try:
                await self._run(key, remove=ids)
            except Exception as exc:  # the leases expire on their own
                self._failed(exc)

        task = asyncio.get_running_loop().create_task(release(), name="admission-release")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def _failed(self, exc: Exception) -> AdmissionUnavailable:
        now = time.monotonic()
        self.down_until = now + REDIS_RETRY_S
        if self.down_since is None or now - self._warned_at > 60:  # one line an outage (a reminder a minute)
            self.down_since = now if self.down_since is None else self.down_since
            self._warned_at = now
            log.warning("admission: Redis failed (%s: %s); XGEN_ADMISSION_ON_REDIS_ERROR=%s: %s until it is back",
                        exc.__class__.__name__, exc, settings.ADMISSION_ON_REDIS_ERROR,
                        "this process's own queue and max_concurrency" if settings.ADMISSION_ON_REDIS_ERROR == "local"
                        else "requests to models with max_concurrency are refused (503)")
        return AdmissionUnavailable(str(exc))

    def _recovered(self) -> None:
        if self.down_since is not None:
            self.down_since = None
            log.warning("admission: Redis is back; max_concurrency and the queues are cluster-wide again")

    async def _ensure_listening(self) -> None:
        if self._listener is None or self._listener.done():
            self._subscribed = asyncio.Event()
            self._listener = asyncio.get_running_loop().create_task(self._listen(), name="admission-grants")
        assert self._subscribed is not None
        if not self._subscribed.is_set():
            async with asyncio.timeout(2):
                waiter = asyncio.ensure_future(self._subscribed.wait())
                done, _ = await asyncio.wait({waiter, self._listener}, return_when=asyncio.FIRST_COMPLETED)
                if waiter not in done:
                    waiter.cancel()
                    raise ConnectionError("admission: the grant subscription failed")

    async def _listen(self) -> None:
        assert self._subscribed is not None
        pubsub = self._redis.pubsub()
        try:
            await pubsub.subscribe(self.channel)
            self._subscribed.set()
            while True:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                if msg is None or msg.get("type") != "message":
                    continue
                key, _, wid = msg["data"].decode().rpartition(" ")
                fut = self._waiting.get(key, {}).get(wid)
                if fut is not None and not fut.done():
                    fut.set_result(True)
        except Exception as exc:  # the next acquire subscribes again; what waits here falls back now
            if self._waiting:
                self._failed(exc)
            self._fail_waiters()
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    def _fail_waiters(self) -> None:
        self.close_waiters(AdmissionUnavailable("Redis failed while waiting"))

    def close_waiters(self, exc: Exception) -> int:
        """Answer every request waiting here with `exc` (Redis failed, or the process stops)."""
        count = 0
        for waiters in self._waiting.values():
            for fut in waiters.values():
                if not fut.done():
                    fut.set_exception(exc)
                    count += 1
        return count

    def _ensure_renewer(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_loop(), name="admission-leases")

    async def _renew_loop(self) -> None:
        """One task per process: renew every lease and waiter held here each third of the lease;
        wake a waiter whose grant message was lost; hand on a dead process's expired slots."""
        while self._held or self._waiting:
            await asyncio.sleep(settings.ADMISSION_LEASE_S / 3)
            for key in set(self._held) | set(self._waiting):
                ids = [*self._held.get(key, ()), *self._waiting.get(key, {})]
                try:
                    raw = await self._run(key, renew=ids)
                except Exception as exc:
                    self._failed(exc)
                    self._fail_waiters()
                    continue
                self._recovered()
                waiters = self._waiting.get(key, {})
                for wid in raw[2:]:
                    fut = waiters.get(wid.decode() if isinstance(wid, bytes) else wid)
                    if fut is not None and not fut.done():
                        fut.set_result(True)

    async def close(self) -> None:
        for key in list(self._release_timers):
            self._send_releases(key)
        await cancel_and_wait(self._renewer)
        await cancel_and_wait(self._listener)
        for task in list(self._releases):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 2)
        for key, ids in list(self._held.items()):
            for wid in ids:
                with contextlib.suppress(Exception):
                    await self._run(key, remove=wid)
        self._held.clear()
        with contextlib.suppress(Exception):
            await self._redis.aclose()


_shared: ClusterAdmission | None = None
_shared_loop: asyncio.AbstractEventLoop | None = None


def cluster_admission() -> ClusterAdmission | None:
    """This process's cluster admission (None in embedded mode: no REDIS_URL)."""
    global _shared, _shared_loop
    url = getattr(settings, "REDIS_URL", None)
    if not url:
        return None
    loop = asyncio.get_running_loop()
    if _shared is None or _shared_loop is not loop:
        _shared_loop = loop
        _shared = ClusterAdmission(url)
    return _shared


def current() -> ClusterAdmission | None:
    """The cluster admission made already (None: none yet, or embedded mode); never makes one."""
    return _shared


def degraded_since() -> float | None:
    """Monotonic time since which admission fell back to this process's queues (None: it is fine)."""
    return _shared.down_since if _shared is not None else None


async def shutdown_cluster_admission() -> None:
    global _shared
    if _shared is not None:
        await _shared.close()
        _shared = None
