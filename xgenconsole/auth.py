"""Authentication for pages (session), the API (bearer key or session) and role checks."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.middleware import LoginRequiredMiddleware
from django.http import HttpRequest
from django.utils import timezone
from ninja.security import HttpBearer, SessionAuth

from accounts.errors import ApiError
from xgenconsole.models import ApiKey, User, hash_key

# Paths with their own auth (bearer key or session, answered as JSON), not login redirects.
API_PREFIXES = ("/api/", "/v1/", "/metrics")


class LoginRequiredPagesMiddleware(LoginRequiredMiddleware):
    """Every page needs login (Django 5.1+ default-deny); API paths answer 401 JSON instead."""

    def process_view(self, request, view_func, view_args, view_kwargs):
        if request.path.startswith(API_PREFIXES):
            return None
        return super().process_view(request, view_func, view_args, view_kwargs)


@dataclass(frozen=True)
class Principal:
    """Who a bearer key acts for, as cached by the hot path."""

    user_id: int
    username: str
    role: str
    key_id: int

    def has_role(self, needed: str) -> bool:
        from xgenconsole.models import ROLE_RANK, Role

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


alookup_key = sync_to_async(lookup_key, thread_sensitive=False)


class _RoleCheck:
    """Mixed into the auth classes: after authenticating, the user's role must reach `role`.

    Checking the role in auth (not in the view body) means a 403 comes before the request
    body is even parsed, and every operation declares its role where a test can read it.
    """

    role: str = "viewer"

    def _allowed(self, user: User | None) -> User | None:
        if user is None:
            return None
        if not user.has_role(self.role):
            raise ApiError(403, f"This needs the {self.role} role; you are {user.role}.", code="insufficient_role")
        return user


class ApiKeyAuth(_RoleCheck, HttpBearer):
    """`Authorization: Bearer <key>`; request.auth becomes the key's user."""

    def __init__(self, role: str = "viewer") -> None:
        super().__init__()
        self.role = role

    def authenticate(self, request: HttpRequest, token: str) -> User | None:
        principal = lookup_key(token)
        if principal is None:
            return None
        user = User.objects.filter(pk=principal.user_id, is_active=True).first()
        if user is not None:
            request.user = user
        return self._allowed(user)


class SessionAuthWithCsrf(_RoleCheck, SessionAuth):
    """The browser's session; unsafe methods must carry the CSRF token (ninja checks it)."""

    def __init__(self, role: str = "viewer") -> None:
        super().__init__()
        self.role = role

    def authenticate(self, request: HttpRequest, key: str | None) -> User | None:
        user = request.user
        if user.is_authenticated and user.is_active:
            return self._allowed(user)
        return None


def auth_for(role: str) -> list:
    """Ninja `auth=` for an operation that needs `role` (bearer key or session)."""
    return [ApiKeyAuth(role), SessionAuthWithCsrf(role)]


api_auth = auth_for("viewer")
operator_auth = auth_for("operator")
admin_auth = auth_for("admin")


def require_role(request: HttpRequest, role: str) -> User:
    """The authenticated user, or a 403 if their role is below `role`."""
    user = getattr(request, "auth", None) or request.user
    if not getattr(user, "is_authenticated", False):
        raise ApiError(401, "Authentication required: send 'Authorization: Bearer <key>'.", code="unauthorized")
    if not user.has_role(role):
        raise ApiError(
            403, f"This needs the {role} role; you are {user.role}.", code="insufficient_role"
        )
    return user
