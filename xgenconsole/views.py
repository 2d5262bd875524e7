"""Project-level views: health (readyz asks the database, the channel layer and the nodes),
and the JSON or HTML answer for unknown routes and errors."""
from __future__ import annotations

import logging
import uuid

from channels.layers import get_channel_layer
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt

from accounts.errors import json_error
from hardware.models import Node
from live.db import run_db

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


@login_not_required
async def readyz(request: HttpRequest) -> JsonResponse:
    """Ready = the database and the channel layer answer and a node agent heartbeats.

    Anyone may ask (load balancers do), so the reasons name what is wrong, never the driver's
    text (hosts, users, paths): that goes to the log.
    """
    reasons: list[str] = []
    nodes: list[str] | None = None
    try:
        nodes = await run_db(_fresh_node_names)
        loading = await run_db(_autostart_loading)
        if loading:
            reasons.append(f"autostart models still loading: {', '.join(loading[:10])}")
    except Exception:  # any driver error means not ready
        log.warning("readyz: the database check failed", exc_info=True)
        reasons.append("database unavailable")
    try:
        layer = get_channel_layer()
        channel = await layer.new_channel("readyz.")
        token = uuid.uuid4().hex
        await layer.send(channel, {"type": "readyz.ping", "token": token})
        message = await layer.receive(channel)
        if message.get("token") != token:
            reasons.append("channel layer: a different message came back")
    except Exception:
        log.warning("readyz: the channel layer check failed", exc_info=True)
        reasons.append("channel layer unavailable")
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
def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if request.path.startswith(("/api/", "/v1/")):
        return json_error(404, f"No route at {request.path}.", code="not_found")
    return render(request, "404.html", status=404)


@login_not_required
def server_error(request: HttpRequest) -> HttpResponse:
    if request.path.startswith(("/api/", "/v1/")):
        return json_error(500, "Internal error; the server log has the details.", code="internal_error")
    return render(request, "500.html", status=500)
