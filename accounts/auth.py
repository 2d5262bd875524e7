"""Authentication for pages (session), the API (bearer key or session) and role checks."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib.auth.middleware import LoginRequiredMiddleware
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from ninja.security import HttpBearer, SessionAuth

from accounts.credentials import lookup_key, scope_refused
from accounts.errors import ApiError
from accounts.models import User

View = Callable[..., HttpResponse]

# Paths with their own auth (bearer key or session, answered as JSON), not login redirects.
API_PREFIXES = ("/api/", "/v1/", "/metrics")


class LoginRequiredPagesMiddleware(LoginRequiredMiddleware):
    """Every page needs login (Django 5.1+ default-deny); API paths answer 401 JSON instead."""

    def process_view(self, request, view_func, view_args, view_kwargs):
        if request.path.startswith(API_PREFIXES):
            return None
        return super().process_view(request, view_func, view_args, view_kwargs)


def scope_for(request: HttpRequest) -> str:
    """The key scope a call needs: inference under /api/inference/, read for GET, HEAD and
    OPTIONS, manage for every other method."""
    if request.path.startswith("/api/inference/"):
        return "inference"
    return "read" if request.method in ("GET", "HEAD", "OPTIONS") else "manage"


def visible_models(request: HttpRequest) -> frozenset[str] | None:
    """The models whose rows a caller may read: its key's allowed_models, or None (every model:
    a session, or a key without allowed_models)."""
    principal = getattr(request, "api_principal", None)
    return principal.allowed_models if principal is not None else None


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
            request.api_key_id = principal.key_id  # the audit log says which key acted
            request.api_principal = principal  # its allowed_models narrow what it reads
            scope = scope_for(request)
            if not principal.has_scope(scope):
                raise ApiError(403, scope_refused(principal, scope), code="insufficient_scope")
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


def role_required(role: str) -> Callable[[View], View]:
    """Page decorator: the signed-in user needs `role` or above, else 403."""

    def decorator(view: View) -> View:
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.has_role(role):
                raise PermissionDenied(f"This page needs the {role} role.")
            return view(request, *args, **kwargs)

        wrapped.__name__ = view.__name__
        wrapped.__doc__ = view.__doc__
        wrapped.__dict__["required_role"] = role  # read by the auth matrix test
        return wrapped

    return decorator
