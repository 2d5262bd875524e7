"""Who is calling, from credentials alone: a bearer key or the console's session, each cached for
a few seconds, so hot paths (the inference proxy, the body guard) skip the database.

`lookup_key` serves Ninja's bearer auth too (accounts.auth); `authenticate` checks raw ASGI
headers the way Django would (session hash, CSRF token and Origin on writes).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.cookies import SimpleCookie

from django.conf import settings
from django.contrib.auth.signals import user_logged_out
from django.utils import timezone

from accounts.errors import ErrorAnswer
from accounts.models import ROLE_RANK, ApiKey, Role, hash_key
from live.db import db_async


@dataclass(frozen=True)
class Principal:
    """Who a bearer key acts for, as cached by the hot path."""

    user_id: int
    username: str
    role: str
    key_id: int

    def has_role(self, needed: str) -> bool:
        return ROLE_RANK[Role(self.role)] >= ROLE_RANK[Role(needed)]


class PrincipalCache:
    """Credential (key hash, session key) -> Principal for a few seconds, so hot paths skip
    the database. Clearing takes effect at once in this process; others see it within the TTL.

    `ttl_s` is a number or a callable read at each put (so settings changes apply).
    """

    def __init__(self, ttl_s: float | Callable[[], float]) -> None:
        self._ttl = ttl_s
        self._entries: dict[str, tuple[float, Principal | None]] = {}
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def get(self, credential: str) -> tuple[bool, Principal | None]:
        entry = self._entries.get(credential)
        if entry is None or entry[0] < time.monotonic():
            return False, None
        return True, entry[1]

    def put(self, credential: str, principal: Principal | None) -> None:
        ttl = self._ttl() if callable(self._ttl) else self._ttl
        if ttl <= 0:
            return
        with self._lock:
            if len(self._entries) > 10_000:
                self._entries.clear()
            self._entries[credential] = (time.monotonic() + ttl, principal)


key_cache = PrincipalCache(lambda: settings.API_KEY_CACHE_S)


def lookup_key(raw: str) -> Principal | None:
    """The principal for a raw bearer key, or None; touches the database at most once per TTL."""
    if not raw or len(raw) > 200:
        return None
    digest = hash_key(raw)
    hit, principal = key_cache.get(digest)
    if hit:
        return principal
    key = ApiKey.objects.select_related("user").filter(key_hash=digest).first()
    principal = None
    if key is not None and key.is_usable:
        role = "admin" if key.user.is_superuser else key.user.role
        principal = Principal(user_id=key.user_id, username=key.user.username, role=role, key_id=key.pk)
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=timezone.now())
    key_cache.put(digest, principal)
    return principal


# Through the one DB bridge: a worker thread's connection is closed around each lookup and a
# lookup whose connection was lost (a database restart) runs again on a new one.
alookup_key = db_async(lookup_key)

SESSION_CACHE_S = 5.0

# Session key -> Principal: the playground and other browser calls skip the database.
session_cache = PrincipalCache(SESSION_CACHE_S)


def _forget_sessions(**kwargs) -> None:
    session_cache.clear()  # a logout in this process takes effect at once, not after SESSION_CACHE_S


user_logged_out.connect(_forget_sessions, dispatch_uid="xgen-proxy-session-cache")


def _session_principal(session_key: str) -> Principal | None:
    """The signed-in user of a Django session (hash-verified like django.contrib.auth), or None."""
    from importlib import import_module

    from django.contrib.auth import get_user

    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)

    class _SessionOnly:  # get_user() reads nothing but request.session
        session = store

    user = get_user(_SessionOnly)
    if not user.is_authenticated or not user.is_active:
        return None
    role = "admin" if user.is_superuser else user.role
    return Principal(user_id=user.pk, username=user.username, role=role, key_id=0)


_asession_principal = db_async(_session_principal)


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
    origin_s = origin.decode("latin-1")
    host = headers.get(b"host", b"").decode("latin-1")
    return origin_s == f"{scheme}://{host}" or origin_s in settings.CSRF_TRUSTED_ORIGINS


async def authenticate(headers: dict[bytes, bytes], *, method: str, scheme: str = "http") -> Principal:
    """A bearer key (cached, no database per request) or the console's session (+CSRF on writes),
    read from raw ASGI headers; ErrorAnswer 401 or 403 (csrf_failed) otherwise."""
    auth = headers.get(b"authorization")
    if auth is not None:
        scheme_word, _, raw = auth.decode("latin-1").partition(" ")
        raw = raw.strip()
        principal = None
        if scheme_word.lower() == "bearer" and raw and len(raw) <= 200:
            hit, principal = key_cache.get(hash_key(raw))
            if not hit:
                principal = await alookup_key(raw)
        if principal is None:
            raise ErrorAnswer(401, "Invalid API key.", code="invalid_api_key",
                              headers=[(b"www-authenticate", b"Bearer")])
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
            hit, principal = session_cache.get(morsel.value)
            if not hit:
                principal = await _asession_principal(morsel.value)
                session_cache.put(morsel.value, principal)
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
