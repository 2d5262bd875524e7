"""The key cache (issue 18 and 17 #11): expiry is checked on every hit, a revoke that lands while a
lookup reads cannot re-cache the key, stale entries are served while one refresh runs, changes
are pushed to other processes over the channel layer, and last_used_at is written in batches."""
from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from accounts import credentials
from accounts.credentials import key_cache, lookup_key
from accounts.models import ApiKey, hash_key
from accounts.services import create_api_key, revoke_api_key


@pytest.fixture(autouse=True)
def _fresh_cache(settings):
    settings.API_KEY_CACHE_S = 30
    key_cache.clear()
    yield
    key_cache.clear()


@pytest.mark.django_db
def test_an_expired_key_stops_working_at_once_though_it_is_cached(viewer):
    key, raw = create_api_key(user=viewer.user, name="short-lived",
                              expires_at=timezone.now() + timedelta(seconds=0.4))
    assert lookup_key(raw) is not None  # cached now, for 30 s
    time.sleep(0.5)
    assert lookup_key(raw) is None


@pytest.mark.django_db
def test_a_revoke_between_the_lookups_read_and_its_cache_write_is_not_undone(viewer, monkeypatch):
    key, raw = create_api_key(user=viewer.user, name="raced")
    real_put = key_cache.put

    def put_after_a_revoke(*args, **kwargs):
        revoke_api_key(key=ApiKey.objects.get(pk=key.pk))  # lands after the read, before the put
        monkeypatch.setattr(key_cache, "put", real_put)
        return real_put(*args, **kwargs)

    monkeypatch.setattr(key_cache, "put", put_after_a_revoke)
    lookup_key(raw)  # read while the key was still usable
    assert lookup_key(raw) is None  # ...but the revoked key was not cached as usable


@pytest.mark.django_db
def test_a_cached_key_carries_its_limits(viewer):
    _, raw = create_api_key(user=viewer.user, name="limited", rpm=3, tpm=1000, daily_tokens=50,
                            monthly_tokens=500, allowed_models=["b", "a"], priority=4)
    p = lookup_key(raw)
    assert (p.rpm, p.tpm, p.daily_tokens, p.monthly_tokens, p.priority) == (3, 1000, 50, 500, 4)
    assert p.allowed_models == frozenset({"a", "b"}) and p.may_use("a") and not p.may_use("c") and p.limited
    _, plain = create_api_key(user=viewer.user, name="plain")
    q = lookup_key(plain)
    assert q.allowed_models is None and q.may_use("anything") and not q.limited


@pytest.mark.django_db(transaction=True)
async def test_a_stale_key_is_served_while_one_refresh_runs_in_the_background(viewer, monkeypatch):
    _, raw = await asyncio.to_thread(create_api_key, user=viewer.user, name="swr")
    assert await credentials.alookup_key(raw) is not None
    digest = hash_key(raw)
    when, principal = key_cache._entries[digest]
    key_cache._entries[digest] = (when - 31, principal)  # past its TTL: stale
    reads = []
    real = credentials._aload_key

    async def slow_read(d):
        reads.append(d)
        await asyncio.sleep(0.3)
        return await real(d)

    monkeypatch.setattr(credentials, "_aload_key", slow_read)
    started = time.monotonic()
    results = await asyncio.gather(*(credentials.alookup_key(raw) for _ in range(5)))
    assert time.monotonic() - started < 0.2  # nobody waited for the read
    assert all(r == principal for r in results) and reads == [digest]  # one refresh for all
    await asyncio.sleep(0.5)
    assert key_cache.peek(digest)[0] == credentials.FRESH


@pytest.mark.django_db(transaction=True)
async def test_a_change_pushed_by_another_process_clears_this_ones_cache(viewer):
    from channels.layers import get_channel_layer

    _, raw = await asyncio.to_thread(create_api_key, user=viewer.user, name="pushed")
    assert await credentials.alookup_key(raw) is not None
    credentials.upkeep.ensure_started()
    try:
        await asyncio.sleep(0.1)  # joined the group
        layer = get_channel_layer()
        await layer.group_send(credentials.CREDENTIALS_GROUP, {
            "type": "credentials.changed", "scope": "keys", "credential": hash_key(raw), "origin": "another"})
        for _ in range(40):
            if key_cache.peek(hash_key(raw))[0] == credentials.MISS:
                break
            await asyncio.sleep(0.05)
        assert key_cache.peek(hash_key(raw))[0] == credentials.MISS
    finally:
        await credentials.upkeep.stop()


@pytest.mark.django_db
def test_last_used_is_written_in_batches_not_by_each_request(viewer):
    credentials.flush_last_used()  # (what earlier tests left)
    key, raw = create_api_key(user=viewer.user, name="batched")
    for _ in range(3):
        assert lookup_key(raw) is not None
    key.refresh_from_db()
    assert key.last_used_at is None  # nothing written on the request path
    assert credentials.flush_last_used() >= 1
    key.refresh_from_db()
    assert key.last_used_at is not None and timezone.now() - key.last_used_at < timedelta(seconds=5)


@pytest.mark.django_db(transaction=True)
async def test_a_key_in_use_is_kept_fresh_between_its_requests(viewer, settings):
    """The upkeep loop re-reads keys looked up within their serving window (10 TTLs) once they
    are half a TTL old, all in one query: the next request after an idle gap past the TTL finds
    the key fresh (with any change made without a push), instead of starting a refresh beside
    itself. A key not looked up for the whole window is left to expire."""
    settings.API_KEY_CACHE_S = 1
    key, raw = await asyncio.to_thread(create_api_key, user=viewer.user, name="in-use")
    _, other_raw = await asyncio.to_thread(create_api_key, user=viewer.user, name="other")
    digest, other = hash_key(raw), hash_key(other_raw)
    assert await credentials.alookup_key(raw) is not None
    assert await credentials.alookup_key(other_raw) is not None
    await ApiKey.objects.filter(pk=key.pk).aupdate(name="renamed")  # no push: only a re-read shows it
    reads = []
    real = credentials._reload_keys

    def counted(digests):
        reads.append(sorted(digests))
        return real(digests)

    async def until(condition) -> None:  # the upkeep ticks about once a second
        for _ in range(100):
            if condition():
                return
            await asyncio.sleep(0.05)

    credentials._areload_keys = credentials.db_async(counted)
    credentials.upkeep.ensure_started()
    try:
        await asyncio.sleep(1.2)  # no request from here on: past the TTL, fresh only if re-read
        await until(lambda: key_cache.peek(digest)[1].key_name == "renamed"
                    and key_cache.peek(digest)[0] == key_cache.peek(other)[0] == credentials.FRESH)
        state, principal = key_cache.peek(digest)
        assert state == credentials.FRESH and principal.key_name == "renamed"
        assert key_cache.peek(other)[0] == credentials.FRESH
        assert reads and all(batch == sorted([digest, other]) for batch in reads)  # one query for both
        key_cache._used[other] -= 11  # as if last looked up 11 s (11 TTLs) ago
        await until(lambda: other not in key_cache._used)  # dropped at the next tick
        reads.clear()
        await until(lambda: reads and key_cache.peek(other)[0] == credentials.STALE)
        assert reads and all(batch == [digest] for batch in reads)
        assert key_cache.peek(other)[0] == credentials.STALE and other not in key_cache._used
    finally:
        credentials._areload_keys = credentials.db_async(real)
        await credentials.upkeep.stop()


def test_refresh_ahead_picks_entries_used_in_their_window_past_half_their_ttl_when_quiet():
    cache = credentials.PrincipalCache(10)
    now = time.monotonic()
    cache._entries.update({"young": (now - 2, None), "due": (now - 6, None), "unused": (now - 6, None),
                           "busy": (now - 6, None), "busy-late": (now - 9.5, None), "too-old": (now - 101, None),
                           "forgotten": (now - 6, None)})
    for credential in ("young", "due", "too-old", "gone"):
        cache._used[credential] = now - 1  # looked up a second ago
    cache._used["forgotten"] = now - 100  # ten TTLs ago: left to expire
    cache.mark_used("busy")  # looked up just now: a read beside its request would slow it
    cache.mark_used("busy-late")  # ...but this one is about to go stale: read anyway
    assert sorted(cache.due_for_refresh()) == ["busy-late", "due"]
    assert set(cache._used) == {"young", "due", "too-old", "busy", "busy-late"}
    cache.put("due", None)  # re-read: not due again for half a TTL
    assert sorted(cache.due_for_refresh()) == ["busy-late"]
    cache._used["busy"] = now - 1
    assert sorted(cache.due_for_refresh()) == ["busy", "busy-late"]  # quiet now
    cache.clear()
    assert cache._used == {} and credentials.PrincipalCache(0).due_for_refresh() == []


@pytest.mark.django_db(transaction=True)
async def test_a_browser_session_in_use_is_kept_fresh_too(viewer, monkeypatch):
    from django.test import Client

    from accounts.credentials import session_cache

    def login() -> str:
        client = Client()
        client.force_login(viewer.user)
        return client.cookies["sessionid"].value

    session_key = await asyncio.to_thread(login)
    monkeypatch.setattr(session_cache, "_ttl", 1)
    session_cache.clear()
    assert (await credentials._session_lookup(session_key)).username == viewer.user.username
    await type(viewer.user).objects.filter(pk=viewer.user.pk).aupdate(is_active=False)  # no push
    credentials.upkeep.ensure_started()
    try:
        for _ in range(60):
            if session_cache.peek(session_key) == (credentials.FRESH, None):
                break
            await asyncio.sleep(0.05)
        assert session_cache.peek(session_key) == (credentials.FRESH, None)  # re-read without a request
    finally:
        await credentials.upkeep.stop()
        session_cache.clear()
