"""Project-level views: home, health (readyz asks the database, the channel layer and the nodes),
and the JSON or HTML answer for unknown routes and errors."""
from __future__ import annotations

import uuid

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.contrib.auth.decorators import login_not_required
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.csrf import csrf_exempt

from accounts.errors import json_error
from hardware.models import Node


def home(request: HttpRequest) -> HttpResponse:
    return redirect("instances")


@login_not_required
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def _check_database() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # any driver error means not ready
        return f"database: {exc.__class__.__name__}: {exc}"
    return None


def _fresh_node_names() -> list[str]:
    return list(Node.fresh().values_list("name", flat=True))


@login_not_required
async def readyz(request: HttpRequest) -> JsonResponse:
    reasons: list[str] = []
    db_error = await sync_to_async(_check_database)()
    if db_error:
        reasons.append(db_error)
    try:
        layer = get_channel_layer()
        channel = await layer.new_channel("readyz.")
        token = uuid.uuid4().hex
        await layer.send(channel, {"type": "readyz.ping", "token": token})
        message = await layer.receive(channel)
        if message.get("token") != token:
            reasons.append("channel layer: a different message came back")
    except Exception as exc:
        reasons.append(f"channel layer: {exc.__class__.__name__}: {exc}")
    nodes: list[str] = []
    if not db_error:
        nodes = await sync_to_async(_fresh_node_names)()
        if not nodes:
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
