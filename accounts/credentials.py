"""Who is calling, from credentials alone: a bearer key or the console's session, each cached
so hot paths (the inference proxy, the body guard) skip the database.

`lookup_key` serves Ninja's bearer auth too (accounts.auth); `authenticate` checks raw ASGI
headers the way Django would (session hash, CSRF token and Origin on writes).

The caches (issue 18): an entry is fresh for its TTL, then served stale while one background
refresh re-reads it (the async path; the sync path re-reads inline). A change to keys or users
(revoke, limits, role, deactivation, logout) clears this process's entries at once and is pushed
over the channel layer to every other process (`notify_changed`), which clear theirs on receipt;
a lost push is caught by the TTL. A cached principal carries its key's expiry, checked on every
hit. Every clear bumps a generation counter that a lookup reads before its database read and
that `put` checks, so a revoke landing between the read and the put never re-caches the key.
`last_used_at` is recorded in memory and written in batches off the request path.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from http.cookies import SimpleCookie

from django.conf import settings
from django.contrib.auth.signals import user_logged_out

from accounts.errors import ErrorAnswer
from accounts.models import KEY_SCOPES, ROLE_RANK, ApiKey, Role, Team, hash_key
from accounts.origins import origin_allowed
from live.db import db_async, run_db
from live.groups import GroupListener, send, send_sync
from live.tasks import cancel_and_wait

log = logging.getLogger("xgen.accounts")

CREDENTIALS_GROUP = "accounts.credentials"
STALE_FACTOR = 10  # a cached entry is served (while it is re-read) up to this many TTLs old
# An entry looked up within its serving window (STALE_FACTOR TTLs) is re-read by the process's
# upkeep loop once it is this fraction of its TTL old, so a key in use is fresh when its next
# request comes, however long the gap (a refresh started by the request itself ran beside it:
# +2 ms on that request, measured).
REFRESH_AHEAD = 0.5
REFRESH_QUIET_S = 0.25  # ...when it has not been looked up for this long (a read beside a request slows it),
REFRESH_LATEST = 0.9  # ...or anyway once it is this fraction of its TTL old (a key in constant use)
LAST_USED_FLUSH_S = 10.0
_ORIGIN = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # this process, to skip its own pushes


@dataclass(frozen=True)
class Principal:
    """Who a credential acts for, as cached by the hot path; for a key, its limits too
    (None / empty: unlimited)."""

    user_id: int
    username: str
    role: str
    key_id: int  # 0 for a session
    key_name: str = ""
    expires_at: float | None = None  # epoch seconds
    allowed_models: frozenset[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    daily_tokens: int | None = None
    monthly_tokens: int | None = None
    priority: int = 0
    scopes: frozenset[str] = frozenset(KEY_SCOPES)  # a session may do all its role allows
    # The key's team, as a principal of its own whose limits count every key of the team together
    # (serving.proxy.limits keeps its state under key_id = -team id); None: no team.
    team: Principal | None = None
    # A team's GPU-seconds budget per UTC month (serving.proxy.gpu_budget enforces it); None: none.
    gpu_seconds_month: int | None = None
    slug: str = ""  # a team principal's slug

    @property
    def team_id(self) -> int | None:
        """The team a principal's limits belong to (a team principal's own id), or its key's team."""
        if self.key_id < 0:
            return -self.key_id
        return self.team.team_id if self.team is not None else None

    @property
    def team_slug(self) -> str:
        """The slug of team_id's team ("" for none)."""
        if self.key_id < 0:
            return self.slug
        return self.team.slug if self.team is not None else ""

    def has_role(self, needed: str) -> bool:
        return ROLE_RANK[Role(self.role)] >= ROLE_RANK[Role(needed)]

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (time.time() if now is None else now) >= self.expires_at

    @property
    def limited(self) -> bool:
        """Whether the proxy has a rate limit or quota to enforce for this key."""
        return (self.rpm is not None or self.tpm is not None or self.daily_tokens is not None
                or self.monthly_tokens is not None)

    @property
    def models_limited(self) -> bool:
        """Whether the key or its team names the models it may use."""
        return self.allowed_models is not None or (self.team is not None and self.team.allowed_models is not None)

    def may_use(self, model: str) -> bool:
        """The key's allowed_models and its team's both allow `model`."""
        return ((self.allowed_models is None or model in self.allowed_models)
                and (self.team is None or self.team.may_use(model)))

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes


def scope_refused(principal: Principal, scope: str) -> str:
    """The 403 message for a key without `scope`."""
    return (f"This API key may not do this: it needs the {scope} scope and has "
            f"{', '.join(sorted(principal.scopes)) or 'none'}.")


MISS, FRESH, STALE = "miss", "fresh", "stale"


class PrincipalCache:
    """Credential (key hash, session key) -> Principal (or None: known bad).

    `ttl_s` is a number or a callable read at each use (so settings changes apply); 0 turns the
    cache off. Fresh for the TTL, then stale (served while re-read) up to STALE_FACTOR TTLs.
    """

    def __init__(self, ttl_s: float | Callable[[], float]) -> None:
        self._ttl = ttl_s
        self._entries: dict[str, tuple[float, Principal | None]] = {}
        self._used: dict[str, float] = {}  # credential -> when a request last looked it up
        self._lock = threading.Lock()
        self._generation = 0

    def _ttl_s(self) -> float:
        return self._ttl() if callable(self._ttl) else self._ttl

    @property
    def generation(self) -> int:
        """Read before a database read; `put(..., generation=)` drops the entry if a clear came since."""
        return self._generation

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used.clear()
            self._generation += 1

    def forget(self, credential: str) -> None:
        with self._lock:
            self._entries.pop(credential, None)
            self._used.pop(credential, None)
            self._generation += 1

    def mark_used(self, credential: str) -> None:
        self._used[credential] = time.monotonic()

    def due_for_refresh(self) -> list[str]:
        """Entries looked up within their serving window, now REFRESH_AHEAD of their TTL old and
        quiet for REFRESH_QUIET_S (or REFRESH_LATEST old): to be re-read in the background, off
        any request's path. Entries not looked up for STALE_FACTOR TTLs are left to expire."""
        ttl = self._ttl_s()
        if ttl <= 0 or not self._used:
            return []
        now = time.monotonic()
        window = ttl * STALE_FACTOR
        with self._lock:
            due = []
            for credential, used_at in list(self._used.items()):
                entry = self._entries.get(credential)
                if entry is None or now - used_at >= window:
                    del self._used[credential]
                    continue
                age = now - entry[0]
                if ttl * REFRESH_AHEAD <= age < window and (now - used_at >= REFRESH_QUIET_S
                                                             or age >= ttl * REFRESH_LATEST):
                    due.append(credential)
            return due

    def peek(self, credential: str) -> tuple[str, Principal | None]:
        """(MISS | FRESH | STALE, principal); an expired key's principal reads as None."""
        entry = self._entries.get(credential)
        if entry is None:
            return MISS, None
        ttl = self._ttl_s()
        age = time.monotonic() - entry[0]
        if age >= ttl * STALE_FACTOR or ttl <= 0:
            return MISS, None
        principal = entry[1]
        if principal is not None and principal.expired():
            principal = None
        return (FRESH if age < ttl else STALE), principal

    def get(self, credential: str) -> tuple[bool, Principal | None]:
        """(hit, principal) for a fresh entry."""
        state, principal = self.peek(credential)
        return state == FRESH, principal

    def put(self, credential: str, principal: Principal | None, *, generation: int | None = None) -> bool:
        """Cache `principal`; not when the cache was cleared since `generation` was read. True if kept."""
        if self._ttl_s() <= 0:
            return False
        with self._lock:
            if generation is not None and generation != self._generation:
                return False  # a revoke or change came in while this was read: the read may be stale
            if len(self._entries) > 10_000:
                self._entries.clear()
            self._entries[credential] = (time.monotonic(), principal)
            return True


key_cache = PrincipalCache(lambda: settings.API_KEY_CACHE_S)

SESSION_CACHE_S = 5.0

# Session key -> Principal: the playground and other browser calls skip the database.
session_cache = PrincipalCache(SESSION_CACHE_S)


# ---------------------------------------------------------------- keys
def principal_for_team(team: Team) -> Principal:
    """A team's limits as the proxy's limiter takes them: a principal of key id -team.id (so its
    counters never meet a key's), named after the team."""
    return Principal(
        user_id=0, username=f"team:{team.slug}", role=Role.VIEWER, key_id=-team.pk, key_name=team.name,
        allowed_models=frozenset(team.allowed_models) if team.allowed_models else None,
        rpm=team.rpm, tpm=team.tpm, daily_tokens=team.daily_tokens, monthly_tokens=team.monthly_tokens,
        scopes=frozenset(), gpu_seconds_month=team.gpu_seconds_month, slug=team.slug,
    )


def principal_for_key(key: ApiKey) -> Principal:
    """The cached form of a usable key (its user and team selected)."""
    role = "admin" if key.user.is_superuser else key.user.role
    return Principal(
        user_id=key.user_id, username=key.user.username, role=role, key_id=key.pk, key_name=key.name,
        expires_at=key.expires_at.timestamp() if key.expires_at else None,
        allowed_models=frozenset(key.allowed_models) if key.allowed_models else None,
        rpm=key.rpm, tpm=key.tpm, daily_tokens=key.daily_tokens, monthly_tokens=key.monthly_tokens,
        priority=key.priority, scopes=frozenset(key.scopes if key.scopes is not None else KEY_SCOPES),
        team=principal_for_team(key.team) if key.team is not None else None,
    )


def _load_key(digest: str) -> Principal | None:
    """Read one key by hash and cache what was read (unless a change came in meanwhile)."""
    generation = key_cache.generation
    principal = _usable_principal(ApiKey.objects.select_related("user", "team").filter(key_hash=digest).first())
    key_cache.put(digest, principal, generation=generation)
    return principal


def _usable_principal(key: ApiKey | None) -> Principal | None:
    """What the cache holds for a key read from the database: its principal, or None (refused)."""
    return principal_for_key(key) if key is not None and key.is_usable else None


_aload_key = db_async(_load_key)
_refreshing: set[str] = set()


def _reload_keys(digests: list[str]) -> int:
    """Re-read the cached keys `digests` in one query (the upkeep's refresh ahead); returns how
    many were read. A key gone or no longer usable is cached as refused."""
    generation = key_cache.generation
    found = {k.key_hash: k for k in ApiKey.objects.select_related("user", "team").filter(key_hash__in=digests)}
    for digest in digests:
        key_cache.put(digest, _usable_principal(found.get(digest)), generation=generation)
    return len(digests)


_areload_keys = db_async(_reload_keys)


def lookup_key(raw: str) -> Principal | None:
    """The principal for a raw bearer key, or None (sync callers: Ninja's bearer auth)."""
    if not raw or len(raw) > 200:
        return None
    digest = hash_key(raw)
    state, principal = key_cache.peek(digest)
    if state != FRESH:
        principal = _load_key(digest)
    if principal is not None:
        touch_key(principal.key_id)
        if time.monotonic() - _last_flush[0] > LAST_USED_FLUSH_S and not upkeep.running:
            flush_last_used()  # no background upkeep in this process (a plain Django server)
    return principal


async def alookup_key(raw: str) -> Principal | None:
    """lookup_key for async callers: a stale entry is served while one refresh runs in the background."""
    if not raw or len(raw) > 200:
        return None
    digest = hash_key(raw)
    state, principal = key_cache.peek(digest)
    if state == MISS:
        principal = await _aload_key(digest)
    elif state == STALE:
        _start_revalidate(digest)
    if principal is not None:
        key_cache.mark_used(digest)
        touch_key(principal.key_id)
    return principal


def _start_revalidate(digest: str) -> None:
    if digest not in _refreshing:
        _refreshing.add(digest)
        asyncio.get_running_loop().create_task(_revalidate(digest))


async def _revalidate(digest: str) -> None:
    try:
        await _aload_key(digest)
    except Exception as exc:  # the database is down: keep serving the stale entry until it is back
        log.debug("key refresh failed: %s", exc)
    finally:
        _refreshing.discard(digest)


# ---------------------------------------------------------------- last_used_at, in batches
_last_used: dict[int, float] = {}
_last_flush = [time.monotonic()]


def touch_key(key_id: int) -> None:
    """Remember that a key was used now; written by flush_last_used (no database here)."""
    _last_used[key_id] = time.time()


def flush_last_used() -> int:
    """Write the recorded last-used times (one UPDATE per key used since the last flush)."""
    global _last_used
    _last_flush[0] = time.monotonic()
    pending, _last_used = _last_used, {}
    for key_id, at in list(pending.items()):
        try:
            ApiKey.objects.filter(pk=key_id).update(last_used_at=datetime.fromtimestamp(at, tz=UTC))
        except Exception:
            for kid, when in pending.items():  # keep them for the next flush (the newer time wins)
                _last_used[kid] = max(when, _last_used.get(kid, 0.0))
            raise
    return len(pending)


# ---------------------------------------------------------------- changes, pushed to every process
def notify_changed(scope: str = "keys", credential: str | None = None) -> None:
    """Keys or users changed: clear this process's cache at once and tell every other process.

    `scope` is "keys" (key_cache), "sessions" (session_cache) or "all"; `credential` (a key hash)
    forgets just that key. Never raises: a lost push is caught by the other processes' TTL.
    """
    _apply_change(scope, credential)

    message = {"type": "credentials.changed", "scope": scope, "credential": credential, "origin": _ORIGIN}
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        send_sync(CREDENTIALS_GROUP, message)  # bounded; the other processes' TTL catches a lost one
    else:  # called on an event loop thread: send without blocking it
        loop.create_task(send(CREDENTIALS_GROUP, message))


def _apply_change(scope: str, credential: str | None) -> None:
    if scope in ("keys", "all"):
        if credential:
            key_cache.forget(credential)
        else:
            key_cache.clear()
    if scope in ("sessions", "all"):
        session_cache.clear()


class CredentialUpkeep:
    """Per process, in its event loop: applies changes pushed by other processes, re-reads the
    keys and sessions in use before they go stale (REFRESH_AHEAD), and writes last_used_at every
    LAST_USED_FLUSH_S (and at stop)."""

    def __init__(self) -> None:
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def ensure_started(self) -> None:
        task = self._task
        if task is not None and not task.done():
            try:
                if task.get_loop() is asyncio.get_running_loop():
                    return
            except RuntimeError:
                return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="credentials-upkeep")

    async def _run(self) -> None:
        listener = GroupListener(CREDENTIALS_GROUP)
        while True:
            message = await listener.receive(1.0)
            if message is not None and message.get("origin") != _ORIGIN:
                _apply_change(str(message.get("scope")), message.get("credential"))
            _refresh_ahead()
            if _last_used and time.monotonic() - _last_flush[0] > LAST_USED_FLUSH_S:
                try:
                    await run_db(flush_last_used)
                except Exception as exc:
                    log.warning("writing keys' last_used_at failed (kept for the next try): %s", exc)

    async def stop(self) -> None:
        """Stop listening and write what is left (process shutdown)."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        refresh, _refresh_task[0] = _refresh_task[0], None
        await cancel_and_wait(refresh)
        if _last_used:
            try:
                await run_db(flush_last_used)
            except Exception as exc:
                log.warning("writing keys' last_used_at at shutdown failed: %s", exc)


upkeep = CredentialUpkeep()


_refresh_task: list[asyncio.Task | None] = [None]
SESSION_REFRESHES_PER_TICK = 100  # a session is read on its own (two queries): bounded per tick


def _refresh_ahead() -> None:
    """Keys in use stay fresh between their requests (one query for all that are due, 500 at a
    time), sessions in use likewise; in a task of its own, so that a slow database never holds up
    the changes pushed to the upkeep loop (one such task at a time)."""
    task = _refresh_task[0]
    if task is not None and not task.done():
        return
    digests = [d for d in key_cache.due_for_refresh() if d not in _refreshing]
    for session_key in session_cache.due_for_refresh()[:SESSION_REFRESHES_PER_TICK]:  # the rest: next tick
        _start_revalidate_session(session_key)
    if digests:
        _refresh_task[0] = asyncio.get_running_loop().create_task(_reload_in_batches(digests))


async def _reload_in_batches(digests: list[str]) -> None:
    _refreshing.update(digests)
    try:
        for start in range(0, len(digests), 500):
            await _areload_keys(digests[start:start + 500])
    except Exception as exc:  # the database is down: the entries are served until it is back
        log.debug("key refresh ahead failed: %s", exc)
    finally:
        _refreshing.difference_update(digests)


# ---------------------------------------------------------------- sessions
def _forget_sessions(**kwargs) -> None:
    notify_changed("sessions")  # a logout takes effect at once here, and in other processes on the push


user_logged_out.connect(_forget_sessions, dispatch_uid="xgen-proxy-session-cache")


# A page's request re-checks an SSO session with its provider (accounts.sso_check's middleware, every
# XGEN_SSO_RECHECK_S); the proxy runs no Django middleware, so it refuses an SSO session whose last
# check is later than that by more than this grace, until a page has checked it again.
SSO_PROXY_GRACE_S = 60
# Where a session keeps its single sign-on state (accounts.sso, accounts.oidc, accounts.ldap write it):
# {"source": "oidc"|"ldap", "checked": unix time, "refresh_token": ...}
SSO_SESSION_KEY = "xgen_idp"


def sso_check_age(state: dict) -> float:
    """Seconds since the provider last accepted an SSO session (its state's `checked` time), for
    the page's re-check (accounts.sso_check) and the proxy's refusal (sso_check_overdue) alike."""
    return time.time() - state.get("checked", 0)


def sso_check_overdue(session) -> bool:
    state = session.get(SSO_SESSION_KEY)
    if not state:
        return False
    return sso_check_age(state) > settings.SSO_RECHECK_S + SSO_PROXY_GRACE_S


def _session_principal(session_key: str) -> Principal | None:
    """The signed-in user of a Django session (hash-verified like django.contrib.auth), or None."""
    from importlib import import_module

    from django.contrib.auth import get_user

    generation = session_cache.generation
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)

    class _SessionOnly:  # get_user() reads nothing but request.session
        session = store

    user = get_user(_SessionOnly)
    principal = None
    if user.is_authenticated and user.is_active and not sso_check_overdue(store):
        role = "admin" if user.is_superuser else user.role
        principal = Principal(user_id=user.pk, username=user.username, role=role, key_id=0)
    session_cache.put(session_key, principal, generation=generation)
    return principal


_asession_principal = db_async(_session_principal)
_refreshing_sessions: set[str] = set()


async def _session_lookup(session_key: str) -> Principal | None:
    state, principal = session_cache.peek(session_key)
    if state == MISS:
        principal = await _asession_principal(session_key)
    elif state == STALE:
        _start_revalidate_session(session_key)
    if principal is not None:
        session_cache.mark_used(session_key)
    return principal


def _start_revalidate_session(session_key: str) -> None:
    if session_key not in _refreshing_sessions:
        _refreshing_sessions.add(session_key)
        asyncio.get_running_loop().create_task(_revalidate_session(session_key))


async def _revalidate_session(session_key: str) -> None:
    try:
        await _asession_principal(session_key)
    except Exception as exc:
        log.debug("session refresh failed: %s", exc)
    finally:
        _refreshing_sessions.discard(session_key)


def _csrf_ok(headers: dict[bytes, bytes], cookies: SimpleCookie) -> bool:
    """Django's rule for a session POST: the CSRF header matches the csrftoken cookie."""
    from django.middleware.csrf import InvalidTokenFormat, _check_token_format, _does_token_match

    morsel = cookies.get(settings.CSRF_COOKIE_NAME)
    sent = headers.get(settings.CSRF_HEADER_NAME.removeprefix("HTTP_").replace("_", "-").lower().encode())
    if morsel is None or not sent:
        return False
    try:
        token = sent.decode("latin-1")
        _check_token_format(token)
        _check_token_format(morsel.value)
    except (InvalidTokenFormat, UnicodeDecodeError):
        return False
    return len(morsel.value) == 32 and _does_token_match(token, morsel.value)


def _origin_ok(headers: dict[bytes, bytes], scheme: str) -> bool:
    origin = headers.get(b"origin")
    if origin is None:
        return True
    return origin_allowed(origin.decode("latin-1"), scheme=scheme, host=headers.get(b"host", b"").decode("latin-1"))


async def authenticate(headers: dict[bytes, bytes], *, method: str, scheme: str = "http",
                       scope: str | None = "inference") -> Principal:
    """A bearer key (cached, no database per request) or the console's session (+CSRF on writes),
    read from raw ASGI headers; ErrorAnswer 401 or 403 (csrf_failed) otherwise. A key must also
    hold `scope` (the inference surfaces' by default; None: any key, to judge a body limit):
    403 insufficient_scope."""
    upkeep.ensure_started()
    auth = headers.get(b"authorization")
    if auth is not None:
        scheme_word, _, raw = auth.decode("latin-1").partition(" ")
        raw = raw.strip()
        principal = None
        if scheme_word.lower() == "bearer" and raw and len(raw) <= 200:
            principal = await alookup_key(raw)
        if principal is None:
            raise ErrorAnswer(401, "Invalid API key.", code="invalid_api_key",
                              headers=[(b"www-authenticate", b"Bearer")])
        if scope is not None and not principal.has_scope(scope):
            raise ErrorAnswer(403, scope_refused(principal, scope), code="insufficient_scope")
        return principal
    cookie_header = headers.get(b"cookie")
    if cookie_header:
        cookies = SimpleCookie()
        try:
            cookies.load(cookie_header.decode("latin-1"))
        except Exception:  # a malformed Cookie header is simply no session
            cookies = SimpleCookie()
        morsel = cookies.get(settings.SESSION_COOKIE_NAME)
        if morsel is not None and morsel.value and len(morsel.value) <= 64:
            principal = await _session_lookup(morsel.value)
            if principal is not None:
                if method not in ("GET", "HEAD", "OPTIONS"):
                    if not _origin_ok(headers, scheme):
                        raise ErrorAnswer(403, "Origin checking failed for this session request.",
                                          code="csrf_failed")
                    if not _csrf_ok(headers, cookies):
                        raise ErrorAnswer(403, "CSRF token missing or incorrect: send the X-CSRFToken header.",
                                          code="csrf_failed")
                return principal
    raise ErrorAnswer(401, "Authentication required: send 'Authorization: Bearer <key>' or sign in.",
                      code="unauthorized", headers=[(b"www-authenticate", b"Bearer")])
