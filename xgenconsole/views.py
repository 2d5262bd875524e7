"""Project-level views: health (readyz asks the database, the channel layer and the nodes),
and the JSON or HTML answer for unknown routes and errors."""
from __future__ import annotations

import asyncio
import logging
import sys
import uuid

from channels.layers import get_channel_layer
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.views.decorators.csrf import csrf_exempt

from accounts.errors import json_error
from accounts.query import InvalidQueryParam
from hardware.models import Node
from hardware.services import local_inventory_pending
from live.db import connection_lost, run_db

log = logging.getLogger(__name__)


@login_not_required
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def _fresh_node_names() -> list[str]:
    """The names of the nodes with a fresh heartbeat (the query also proves the database answers)."""
    return list(Node.fresh().values_list("name", flat=True))


def _autostart_loading() -> list[str]:
    """Autostart models on fresh nodes still on their way up (ready waits for them, issue 17 #12)."""
    from serving.models import DesiredState, InstanceState, ModelInstance

    return sorted(set(ModelInstance.objects.filter(
        autostart=True, desired_state=DesiredState.RUNNING, node__in=Node.fresh(),
        state__in=(InstanceState.PENDING, InstanceState.CACHING, InstanceState.LOADING, InstanceState.WARMING,
                   InstanceState.STOPPED)).values_list("model_name", flat=True)))


READY_CHECK_TIMEOUT_S = 3.0  # a probe answers within seconds, whatever hangs behind it


async def _database_reasons() -> tuple[list[str] | None, list[str]]:
    try:
        async with asyncio.timeout(READY_CHECK_TIMEOUT_S):
            nodes = await run_db(_fresh_node_names)
            loading = await run_db(_autostart_loading)
            probing = await run_db(local_inventory_pending)
    except TimeoutError:
        log.warning("readyz: the database did not answer within %.0f s", READY_CHECK_TIMEOUT_S)
        return None, ["database did not answer in time"]
    except Exception:  # any driver error means not ready
        log.warning("readyz: the database check failed", exc_info=True)
        return None, ["database unavailable"]
    reasons = [f"node agent {name} has not saved its first inventory yet" for name in probing]
    return nodes, reasons + ([f"autostart models still loading: {', '.join(loading[:10])}"] if loading else [])


async def _channel_layer_reasons() -> list[str]:
    """A ping sent to a new channel of this process comes back. Twice at most: a websocket
    consumer that closes cancels its receive, and channels-redis may drop what that receive had
    just popped (see live.groups.Receiver), our ping included.

    The channel has the default prefix, as every receiver of the process does: channels-redis lets
    one receive at a time wait on Redis, on its own channel's prefix, so a ping under another prefix
    ("readyz.") waited for whichever listener held that turn: 1 to 5.8 s per ping measured, past
    10 s under load (CI's PostgreSQL restart test)."""
    layer = get_channel_layer()
    for attempt in (1, 2):
        try:
            channel = await layer.new_channel()
            token = uuid.uuid4().hex
            async with asyncio.timeout(READY_CHECK_TIMEOUT_S / 2):
                await layer.send(channel, {"type": "readyz.ping", "token": token})
                message = await layer.receive(channel)
            return [] if message.get("token") == token else ["channel layer: a different message came back"]
        except TimeoutError:
            log.warning("readyz: no answer over the channel layer (attempt %d)", attempt)
        except Exception:
            log.warning("readyz: the channel layer check failed", exc_info=True)
            return ["channel layer unavailable"]
    return ["channel layer did not answer in time"]


@login_not_required
async def readyz(request: HttpRequest) -> JsonResponse:
    """Ready = the database and the channel layer answer, a node agent heartbeats, and the agent
    this process runs (if any) has saved its first inventory (a load would wait for it).

    Anyone may ask (load balancers do), so the reasons name what is wrong, never the driver's
    text (hosts, users, paths): that goes to the log. Each check is bounded: a probe that hangs
    is worse than a 503.
    """
    (nodes, reasons), layer_reasons = await asyncio.gather(_database_reasons(), _channel_layer_reasons())
    reasons += layer_reasons
    if nodes is not None and not nodes:
        reasons.append("no node agent has a fresh heartbeat")
    if reasons:
        return JsonResponse({"status": "not ready", "reasons": reasons}, status=503)
    return JsonResponse({"status": "ready", "nodes": nodes})


@csrf_exempt  # unknown API paths answer JSON 404 whatever the method, never Django's HTML 403
@login_not_required
def api_not_found(request: HttpRequest) -> JsonResponse:
    return json_error(404, f"No API route at {request.path}.", code="not_found")


@login_not_required
def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """A 400: the message of a query parameter the console refused (its own words only, never
    the text of another exception, such as a disallowed Host's)."""
    message = exception.message if isinstance(exception, InvalidQueryParam) else "The request is malformed."
    if request.path.startswith(("/api/", "/v1/")):
        return json_error(400, message, code="invalid_request")
    return render(request, "400.html", {"message": message}, status=400)


@login_not_required
def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if request.path.startswith(("/api/", "/v1/")):
        return json_error(404, f"No route at {request.path}.", code="not_found")
    return render(request, "404.html", status=404)


DATABASE_RETRY_AFTER_S = 5


def database_lost(exc: BaseException | None) -> bool:
    """Whether `exc` says the database cannot be reached now (Django's wrapped errors, or psycopg's own)."""
    if exc is None:
        return False
    if connection_lost(exc):
        return True
    try:
        import psycopg
    except ImportError:  # SQLite-only installs
        return False
    # Raised outside Django's cursor wrapper; a lost connection has no SQLSTATE or class 08.
    state = getattr(exc, "sqlstate", None)
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)) and (not state or state.startswith("08"))


class DatabaseAwayTracebacks(logging.Filter):
    """django.request logs each 5xx with its traceback; for a database that is away the warning of
    database_unavailable says why in one line, and 140 lines per page view would bury an outage's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and database_lost(record.exc_info[1]):
            record.exc_info, record.exc_text = None, None
        return True


def database_unavailable(request: HttpRequest, exc: BaseException | None = None) -> HttpResponse:
    """The one 503 for a database that is away: JSON on the API, a page elsewhere. The page is
    rendered without the request's context (its user and session would ask the database)."""
    log.warning("database unavailable on %s %s: %s", request.method, request.path, exc)
    if request.path.startswith(("/api/", "/v1/")):
        response = json_error(503, "The database is unavailable; try again in a moment.", code="database_unavailable")
    else:
        response = HttpResponse(render_to_string("503.html"), status=503)
    response["Retry-After"] = str(DATABASE_RETRY_AFTER_S)
    return response


@login_not_required
def server_error(request: HttpRequest) -> HttpResponse:
    """A 500, or the 503 above when what failed was reaching the database: Django calls this for an
    exception from any view or middleware (the session and user are loaded in middleware), inside
    the except block, so sys.exc_info() holds it (asgiref carries it into the handler's thread)."""
    exc = sys.exc_info()[1]
    if database_lost(exc):
        return database_unavailable(request, exc)
    if request.path.startswith(("/api/", "/v1/")):
        return json_error(500, "Internal error; the server log has the details.", code="internal_error")
    return render(request, "500.html", status=500)
