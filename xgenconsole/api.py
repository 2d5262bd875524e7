"""The one NinjaAPI: every router, the auth classes, and OpenAI-shaped errors everywhere."""
from __future__ import annotations

import logging

from django.contrib.auth.decorators import login_required
from django.db import InterfaceError, OperationalError
from django.http import Http404, HttpRequest
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, AuthorizationError, HttpError, ValidationError

from accounts.api import audit_router, keys_router, teams_router
from accounts.auth import api_auth
from accounts.bodies import UNKNOWN_FIELD
from accounts.errors import ApiError, json_error
from hardware.api import router as hardware_router
from hub.api import cache_router, download_router, storage_router
from live.db import connection_lost
from serving.web.api import management_router
from serving.web.inference_api import router as inference_router
from serving.web.usage_api import requests_router, usage_router
from xgenconsole.views import database_unavailable

log = logging.getLogger(__name__)

api = NinjaAPI(
    title="XGEN Console API",
    version="1",
    auth=api_auth,
    urls_namespace="api",
    docs_url="/docs",
    # Anyone signed in may read the docs (API users hold viewer keys); anonymous -> login page.
    docs_decorator=login_required,
)

api.add_router("/hardware", hardware_router, tags=["hardware"])
api.add_router("/hardware/nodes", cache_router, tags=["node caches"])  # the hub owns caches
api.add_router("/storage", storage_router, tags=["model store"])
api.add_router("/download", download_router, tags=["downloads"])
api.add_router("/management", management_router, tags=["serving"])
api.add_router("/inference", inference_router, tags=["inference"])
api.add_router("/keys", keys_router, tags=["keys"])
api.add_router("/usage", usage_router, tags=["usage"])
api.add_router("/requests", requests_router, tags=["usage"])
api.add_router("/audit", audit_router, tags=["audit"])
api.add_router("/teams", teams_router, tags=["teams"])


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "payload", "query", "path"))
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "Invalid request: " + "; ".join(parts)


def _unknown_fields(exc: ValidationError) -> list[str]:
    """Each field a strict body (accounts.bodies) does not know, by its path in the body."""
    return [".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "payload", "query", "path"))
            for err in exc.errors if err.get("type") == UNKNOWN_FIELD]


@api.exception_handler(ValidationError)
def on_validation_error(request: HttpRequest, exc: ValidationError):
    unknown = _unknown_fields(exc)
    if unknown:
        names = ", ".join(repr(name[:64]) for name in unknown[:20])
        return json_error(400, f"Unknown field{'s' if len(unknown) > 1 else ''} {names}: this body takes only "
                               "the fields in the API reference (/api/docs).", code="unknown_field")
    return json_error(400, _validation_message(exc), code="invalid_request")


@api.exception_handler(AuthenticationError)
def on_auth_error(request: HttpRequest, exc: AuthenticationError):
    return json_error(
        401, "Authentication required: send 'Authorization: Bearer <key>' or sign in.", code="unauthorized"
    )


@api.exception_handler(AuthorizationError)
def on_authz_error(request: HttpRequest, exc: AuthorizationError):
    return json_error(403, str(exc) or "Forbidden.", code="forbidden")


@api.exception_handler(HttpError)
def on_http_error(request: HttpRequest, exc: HttpError):
    if isinstance(exc, ApiError):
        response = json_error(exc.status_code, exc.message, code=exc.code, type=exc.type)
        if getattr(exc, "retry_after", None):
            response["Retry-After"] = str(exc.retry_after)
        return response
    return json_error(exc.status_code, str(exc), code=None)


@api.exception_handler(Http404)
def on_not_found(request: HttpRequest, exc: Http404):
    return json_error(404, str(exc) or "Not found.", code="not_found")


@api.exception_handler(OperationalError)  # DatabaseUnavailable included
@api.exception_handler(InterfaceError)
def on_database_error(request: HttpRequest, exc: Exception):
    if not connection_lost(exc):
        return on_unexpected(request, exc)
    return database_unavailable(request, exc)


@api.exception_handler(Exception)
def on_unexpected(request: HttpRequest, exc: Exception):
    log.exception("unhandled API error on %s %s", request.method, request.path)
    return json_error(500, "Internal error; the server log has the details.", code="internal_error")
