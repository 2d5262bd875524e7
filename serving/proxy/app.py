"""The inference proxy: one OpenAI-compatible endpoint in front of every READY backend.

A raw ASGI app mounted ahead of Django for `/v1/`, `/api/inference/` and `/metrics`
(Django's handler would add 2-2.5 ms and cap the process near 250 req/s). The same core
(`open_upstream` in upstream.py, `list_models` here) also serves the Ninja routes in
serving/inference_api.py.

Rules held here: one pooled aiohttp session per process; chunks are forwarded as they arrive;
a client that disconnects cancels the upstream request; a backend that dies mid-stream ends
an SSE stream with an error event; every error is OpenAI-shaped JSON.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid

from django.conf import settings

from accounts.credentials import authenticate
from accounts.errors import ErrorAnswer, error_body
from live.db import DatabaseUnavailable, run_db
from serving.fleet_metrics import render_fleet
from serving.proxy import metrics
from serving.proxy.errors import ProxyError
from serving.proxy.replicas import Backend, routing_table
from serving.proxy.upstream import UpstreamReply, open_upstream

log = logging.getLogger("xgen.proxy")

PROXY_PREFIXES = ("/v1/", "/api/inference/", "/metrics")
INFERENCE_PREFIX = "/api/inference"

# Operation by path (after the /api/inference and /embedding prefixes are taken off).
OPERATIONS = {
    "/v1/models": ("GET", "models", None),
    "/v1/chat/completions": ("POST", "chat", "llm"),
    "/v1/completions": ("POST", "completions", "llm"),
    "/v1/embeddings": ("POST", "embeddings", "embedding"),
}

REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")



# ---------------------------------------------------------------- routing
def resolve_operation(path: str) -> tuple[str, str, str | None, bool]:
    """(method, operation, kind, embedding_only) for a proxy path; ProxyError 404 if unknown."""
    rest = path[len(INFERENCE_PREFIX):] if path.startswith(INFERENCE_PREFIX + "/") else path
    embedding_only = rest.startswith("/embedding/v1/")
    if embedding_only:
        rest = rest[len("/embedding"):]
    op = OPERATIONS.get(rest)
    if op is not None and not (embedding_only and op[1] in ("chat", "completions")):
        return op[0], op[1], ("embedding" if embedding_only else op[2]), embedding_only
    if rest.startswith("/v1/models/") and len(rest) > len("/v1/models/"):
        return "GET", "model", None, embedding_only
    raise ProxyError(404, f"Unknown inference path {path}.", code="not_found")


def _model_entry(backends: list[Backend]) -> dict:
    first = backends[0]
    return {
        "id": first.model_name,
        "object": "model",
        "created": min(b.created for b in backends),
        "owned_by": "xgen",
        "type": first.type,
        "backend": first.backend,
        "node": first.node,
        "replicas": len(backends),
        "instances": [{"id": b.instance_id, "node": b.node, "backend": b.backend, "in_flight": b.in_flight}
                      for b in backends],
    }


async def list_models(*, kind: str | None = None) -> dict:
    """Every READY model (one entry per served name, replicas listed) in OpenAI's list shape."""
    snap = await routing_table.snapshot()
    data = [
        _model_entry(group) for name, group in sorted(snap.by_name.items())
        if kind is None or group[0].type == kind
    ]
    return {"object": "list", "data": data}


async def get_model(name: str, *, kind: str | None = None) -> dict:
    """One READY model by served name; ProxyError 404 model_not_found otherwise."""
    snap = await routing_table.snapshot()
    group = snap.by_name.get(name)
    if not group or (kind is not None and group[0].type != kind):
        raise ProxyError(404, f"The model '{name}' does not exist or is not ready.", code="model_not_found")
    return _model_entry(group)


def parse_body(body: bytes) -> dict:
    """The request body as a JSON object; ProxyError 400 otherwise."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ProxyError(400, "The request body is not valid JSON.", code="invalid_json") from None
    except RecursionError:
        raise ProxyError(400, "The request body nests too deeply.", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise ProxyError(400, "The request body must be a JSON object.", code="invalid_request")
    return payload


async def candidates_for(payload: dict, *, kind: str | None) -> list[Backend]:
    """The READY replicas for the body's `model`, or for the path's kind when it names none."""
    snap = await routing_table.snapshot()
    model = payload.get("model")
    if model is not None:
        if not isinstance(model, str) or not model:
            raise ProxyError(400, "`model` must be a non-empty string.", code="invalid_request")
        group = snap.by_name.get(model)
        if group:
            return group
        if model in snap.known_names:
            raise ProxyError(503, f"No backend for '{model}' is ready yet.", code="no_backend")
        raise ProxyError(404, f"The model '{model}' does not exist or is not loaded.", code="model_not_found")
    group = snap.by_type.get(kind or "llm")
    if not group:
        raise ProxyError(503, f"No {kind or 'llm'} model is ready.", code="no_backend")
    return group


def request_id_from(headers: dict[bytes, bytes]) -> str:
    """The caller's X-Request-ID when it is sane, else a new one."""
    sent = headers.get(b"x-request-id")
    if sent:
        value = sent.decode("latin-1")
        if REQUEST_ID_RE.fullmatch(value):
            return value
    return uuid.uuid4().hex


# ---------------------------------------------------------------- the ASGI app
async def read_body(receive, headers: dict[bytes, bytes], *, limit: int, timeout_s: float) -> bytes | None:
    """The request body, refused past `limit` bytes (declared or counted as it arrives) and past
    `timeout_s` seconds in all (a client that trickles its body holds a connection no longer);
    None when the client left. Shared by the proxy and the guard in front of Django."""
    declared = headers.get(b"content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ProxyError(400, "Invalid Content-Length.", code="invalid_request") from None
        if size > limit:
            raise ProxyError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
    parts: list[bytes] = []
    total = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                if chunk:
                    total += len(chunk)
                    if total > limit:
                        raise ProxyError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
                    parts.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise ProxyError(408, f"The request body did not arrive within {timeout_s:g} s.",
                         code="request_timeout", headers=[(b"connection", b"close")]) from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _send_json(send, status: int, body: bytes, *, request_id: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None, content_type: bytes = b"application/json"
                     ) -> None:
    out = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if request_id:
        out.append((b"x-request-id", request_id.encode()))
    if headers:
        out.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": body})


async def proxy_app(scope, receive, send) -> None:
    """ASGI entry for `/v1/`, `/api/inference/` and `/metrics`."""
    if scope["type"] != "http":
        return
    headers = dict(scope["headers"])
    request_id = request_id_from(headers)
    state = {"started": False}

    async def tracked_send(message: dict) -> None:
        if message["type"] == "http.response.start":
            state["started"] = True
        await send(message)

    try:
        try:
            await _handle(scope, receive, tracked_send, headers, request_id)
        except DatabaseUnavailable as exc:
            # A key or session lookup, or the first routing table, needs the database and it is
            # down (restarting): a clean, retryable answer; the next request tries again.
            log.warning("database unavailable for %s %s (request %s): %s", scope.get("method"), scope.get("path"),
                        request_id, exc)
            raise ProxyError(503, "The database is unavailable; try again in a moment.",
                             code="database_unavailable", headers=[(b"retry-after", b"1")]) from None
    except ErrorAnswer as exc:  # ProxyError, or a refused credential
        metrics.record_rejected(exc.code or str(exc.status))
        if not state["started"]:
            await _send_json(send, exc.status, exc.body(), request_id=request_id, headers=exc.headers)
    except Exception:
        log.exception("proxy failed on %s %s (request %s)", scope.get("method"), scope.get("path"), request_id)
        if not state["started"]:
            body = json.dumps(error_body("Internal proxy error; the server log has the details.",
                                         status=500, code="internal_error")).encode()
            await _send_json(send, 500, body, request_id=request_id)


async def _handle(scope, receive, send, headers: dict[bytes, bytes], request_id: str) -> None:
    path: str = scope["path"]
    method: str = scope["method"]
    if path == "/metrics" or path == "/metrics/":
        if method != "GET":
            raise ProxyError(405, "Use GET.", code="method_not_allowed", headers=[(b"allow", b"GET")])
        await authenticate(headers, method=method, scheme=scope.get("scheme", "http"))
        body, content_type = metrics.render_metrics()
        try:  # the dashboard's DB-backed families, rendered in a worker thread, never on the loop
            body += await run_db(render_fleet)
        except DatabaseUnavailable:
            log.warning("/metrics: the database is unreachable; only this process's counters are exported")
        await _send_json(send, 200, body, content_type=content_type.encode())
        return
    if path.startswith("/metrics"):
        raise ProxyError(404, f"Unknown path {path}.", code="not_found")
    await authenticate(headers, method=method, scheme=scope.get("scheme", "http"))
    want, operation, kind, embedding_only = resolve_operation(path)
    if method != want:
        raise ProxyError(405, f"{path} accepts {want} only.", code="method_not_allowed",
                         headers=[(b"allow", want.encode())])
    if operation in ("models", "model"):
        only = "embedding" if embedding_only else None
        if operation == "models":
            answer = await list_models(kind=only)
        else:
            answer = await get_model(path.rsplit("/v1/models/", 1)[1], kind=only)
        await _send_json(send, 200, json.dumps(answer).encode(), request_id=request_id)
        return

    body = await read_body(receive, headers, limit=settings.PROXY_MAX_BODY_BYTES, timeout_s=settings.BODY_TIMEOUT_S)
    if body is None:
        return  # the client left while sending
    payload = parse_body(body)
    candidates = await candidates_for(payload, kind=kind)
    await _forward(scope, receive, send, path=path, body=body, candidates=candidates, request_id=request_id)


async def _forward(scope, receive, send, *, path: str, body: bytes, candidates: list[Backend],
                   request_id: str) -> None:
    """Open the upstream request and pass its answer through, watching for the client leaving."""
    current = asyncio.current_task()
    flags = {"gone": False, "done": False}

    async def watch_disconnect() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not flags["done"]:
                    flags["gone"] = True
                    current.cancel()
                return

    watcher = asyncio.create_task(watch_disconnect())
    reply: UpstreamReply | None = None
    stream = None
    try:
        reply = await open_upstream(path=path, query=scope.get("query_string", b""), body=body,
                                    candidates=candidates, headers=scope["headers"], request_id=request_id)
        if reply.whole_body_size() is not None:
            data = await reply.read_whole()
            flags["done"] = True
            await send({"type": "http.response.start", "status": reply.status, "headers": reply.headers()})
            await send({"type": "http.response.body", "body": data})
            return
        await send({"type": "http.response.start", "status": reply.status, "headers": reply.headers()})
        stream = reply.chunks()
        async for chunk in stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        flags["done"] = True
        # A JSON body the backend cut off ends here too: daphne would hang on an unfinished response,
        # and the truncated JSON already tells the client it is broken.
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not flags["gone"]:
            raise
        current.uncancel()  # the client left: not an error, just stop
    except OSError:
        pass  # the server could not write to a client that went away
    finally:
        flags["done"] = True
        watcher.cancel()
        if stream is not None:
            await stream.aclose()
        if reply is not None:
            reply.abort()
