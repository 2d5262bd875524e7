"""The inference proxy: one OpenAI-compatible endpoint in front of every READY backend.

A raw ASGI app mounted ahead of Django for `/v1/`, `/api/inference/` and `/metrics`
(Django's handler would add 2-2.5 ms and cap the process near 250 req/s). The same core also
serves the Ninja routes in serving/web/inference_api.py and the server-side playground (run_proxy).

This module is the ASGI plumbing and the order of the steps; each step is a module of its own:
bodies (what is read of a request), routing (route, model list, replicas, type rules),
admission (allowed models, limits, quotas, cold-start wait), relay (upstream exchange, answer,
client watch, timing). Rules held: one pooled HTTP/1.1 client per process (http1.py); chunks are
forwarded as they arrive; a client that disconnects cancels the upstream request; a backend that
dies mid-stream ends an SSE stream with an error event; every error is OpenAI-shaped JSON (or
Anthropic's on the Messages paths); every request is counted (serving.proxy.usage) in memory,
written in batches off this path.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from django.conf import settings

from accounts.credentials import authenticate
from accounts.errors import ErrorAnswer, error_body
from live.db import DatabaseUnavailable, run_db
from serving.adapters import ADAPTERS
from serving.proxy import anthropic, metrics, ondemand, resume
from serving.proxy.admission import AfterComments, admit_request, cold_candidates, peek_headers
from serving.proxy.bodies import client_request_id, new_request_id, read_body, request_payload
from serving.proxy.errors import ProxyError
from serving.proxy.fleet_metrics import render_fleet
from serving.proxy.prefix import routing_key
from serving.proxy.relay import ClientWatch, forward, request_task, server_timing
from serving.proxy.routing import (
    ColdStartNeeded,
    Route,
    backend_serves,
    candidates_for,
    check_model_type,
    get_model,
    list_models,
    resolve_alias,
    resolve_route,
    usage_operation,
    with_adapters,
)
from serving.proxy.usage import RequestContext, recorder

log = logging.getLogger("xgen.proxy")

PROXY_PREFIXES = ("/v1/", "/api/inference/", "/metrics")


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
    started = time.perf_counter()
    headers = dict(scope["headers"])
    request_id = new_request_id()
    state = {"started": False}
    peer = scope.get("client")
    ctx = RequestContext(request_id=request_id, client=str(peer[0]) if peer else "")
    recorder.ensure_started()
    ondemand.activity.ensure_started()

    async def tracked_send(message: dict) -> None:
        if message["type"] == "http.response.start":
            state["started"] = True
        await send(message)

    try:
        try:
            ctx.client_request_id = client_request_id(headers)
            await _handle(scope, receive, tracked_send, headers, ctx, started)
        except DatabaseUnavailable as exc:
            # A key or session lookup, or the first routing table, needs the database and it is
            # down (restarting): a clean, retryable answer; the next request tries again.
            log.warning("database unavailable for %s %s (request %s): %s", scope.get("method"), scope.get("path"),
                        request_id, exc)
            raise ProxyError(503, "The database is unavailable; try again in a moment.",
                             code="database_unavailable", headers=[(b"retry-after", b"1")]) from None
    except ErrorAnswer as exc:  # ProxyError, or a refused credential
        metrics.record_rejected(exc.code or str(exc.status))
        if ctx.principal is not None:
            recorder.record_refused(ctx, status=exc.status, code=exc.code)
        if not state["started"]:
            body = _error_for_path(scope["path"], exc.status, exc.message, exc.body())
            await _send_json(send, exc.status, body, request_id=ctx.answer_request_id,
                             headers=[*(exc.headers or []), *ctx.rate_headers, server_timing(started)])
    except asyncio.CancelledError:
        if not ondemand.shutting_down():
            raise
        await _cut_by_shutdown(send, scope["path"], started=state["started"])
    except Exception:
        log.exception("proxy failed on %s %s (request %s)", scope.get("method"), scope.get("path"), request_id)
        if ctx.principal is not None:
            recorder.record_refused(ctx, status=500, code="internal_error")
        if not state["started"]:
            message = "Internal proxy error; the server log has the details."
            body = json.dumps(error_body(message, status=500, code="internal_error")).encode()
            body = _error_for_path(scope["path"], 500, message, body)
            await _send_json(send, 500, body, request_id=ctx.answer_request_id,
                             headers=[*ctx.rate_headers, server_timing(started)])


async def _cut_by_shutdown(send, path: str, *, started: bool) -> None:
    """The server's shutdown grace ran out with this request still answering (SIGTERM): it ends
    here, told so (an SSE error event, or a 503), instead of a cut connection and a traceback. Its
    request-log row comes from where it stood (the relay's own accounting)."""
    request_task().uncancel()
    error = ProxyError(503, "The console is shutting down; this answer was cut short.", code="shutting_down")
    with contextlib.suppress(Exception):
        if started:
            await send({"type": "http.response.body", "body": b"data: " + error.body() + b"\n\n", "more_body": False})
        else:
            await _send_json(send, 503, _error_for_path(path, 503, error.message, error.body()),
                             headers=[(b"retry-after", b"2")])


def _error_for_path(path: str, status: int, message: str, body: bytes) -> bytes:
    """The proxy's own error body: Anthropic's shape on the Messages paths, OpenAI's elsewhere."""
    if anthropic.is_messages_path(path):
        return anthropic.error_bytes(status, message)
    return body



async def _handle(scope, receive, send, headers: dict[bytes, bytes], ctx: RequestContext, started: float) -> None:
    path: str = scope["path"]
    method: str = scope["method"]
    headers = anthropic.with_api_key_auth(headers)
    if path == "/metrics" or path == "/metrics/":
        if method != "GET":
            raise ProxyError(405, "Use GET.", code="method_not_allowed", headers=[(b"allow", b"GET")])
        reader = await authenticate(headers, method=method, scheme=scope.get("scheme", "http"), scope="read")
        exposition, content_type = metrics.render_metrics()
        try:  # the dashboard's DB-backed families, rendered in a worker thread, never on the loop
            exposition += await run_db(render_fleet)
        except DatabaseUnavailable:
            log.warning("/metrics: the database is unreachable; only this process's counters are exported")
        if reader.allowed_models is not None:  # a key limited to some models reads theirs only
            exposition = metrics.only_models(exposition, reader.allowed_models)
        await _send_json(send, 200, exposition, content_type=content_type.encode())
        return
    if path.startswith("/metrics"):
        raise ProxyError(404, f"Unknown path {path}.", code="not_found")
    principal = await authenticate(headers, method=method, scheme=scope.get("scheme", "http"))
    route = resolve_route(path)
    if method != route.method:
        raise ProxyError(405, f"{path} accepts {route.method} only.", code="method_not_allowed",
                         headers=[(b"allow", route.method.encode())])
    if route.operation in ("models", "model"):
        only = "embedding" if route.embedding_only else None
        if route.operation == "models":
            answer = await list_models(kind=only, principal=principal)
        else:
            answer = await get_model(path.rsplit("/v1/models/", 1)[1], kind=only, principal=principal)
        await _send_json(send, 200, json.dumps(answer).encode(), request_id=ctx.answer_request_id,
                         headers=[*await peek_headers(principal), server_timing(started)])
        return

    body = await read_body(receive, headers, limit=settings.PROXY_MAX_BODY_BYTES, timeout_s=settings.BODY_TIMEOUT_S)
    if body is None:
        return  # the client left while sending
    payload, form = request_payload(body, headers, path=route.upstream_path)
    payload, body = await resolve_alias(payload, body, form=form)
    ctx.principal = principal  # from here on, the request is in the request log
    body = await admit_request(ctx, payload, body, operation=usage_operation(route.upstream_path))
    watch = ClientWatch(receive)  # one watch for the client leaving, from a cold start to the relay's end
    try:
        await _route_and_relay(scope, send, path, route, payload, body, ctx, started, watch, form)
    finally:
        watch.close()


async def _route_and_relay(scope, send, path: str, route: Route, payload: dict, body: bytes, ctx: RequestContext,
                           started: float, watch: ClientWatch, form: bytes | None) -> None:
    try:
        candidates = await candidates_for(payload, kind=route.kind, principal=ctx.principal)
        check_model_type(candidates, route, payload)
    except ColdStartNeeded as need:
        # Waited for with the client watched (a client that leaves leaves the wait); the model's
        # type was checked before it was started.
        started_cold = await cold_candidates(need, send, route, ctx, watch)
        if started_cold is None:
            return
        candidates = started_cold
        if ctx.comments_sent:
            send = AfterComments(send)
    if form is None and route.kind != "embedding" and len(candidates) > 1:  # replicas: by the prompt's start
        ctx.route_key = routing_key(payload, settings.ROUTING_PREFIX_CHARS)
    if form is None and candidates[0].adapters:  # LoRA adapters: which apply (llama-server's per-request `lora`)
        body = with_adapters(candidates, body, payload.get("model"))
    upstream_path = route.upstream_path
    if anthropic.is_messages_path(upstream_path):
        if not backend_serves(candidates[0], upstream_path):
            translation = anthropic.Translation(payload, count_only=upstream_path.endswith("/count_tokens"))
            ctx.usage_asked = translation.stream  # its chat stream asks usage for the message_delta
            chat_body = translation.chat_body()
            if candidates[0].adapters:
                chat_body = with_adapters(candidates, chat_body, payload.get("model"))
            await forward(scope, watch, send, path=path, body=chat_body, candidates=candidates,
                          ctx=ctx, started=started, upstream_path="/v1/chat/completions",
                          relay=translation.relay)
            return
        await forward(scope, watch, send, path=path, body=body, candidates=candidates, ctx=ctx,
                      started=started, upstream_path=upstream_path, shape_error=anthropic.backend_error, form=form)
        return
    if not backend_serves(candidates[0], upstream_path):
        label = getattr(ADAPTERS.get(candidates[0].backend), "label", candidates[0].backend)
        raise ProxyError(404, f"{label} (the backend serving '{candidates[0].model_name}') does not serve "
                              f"{upstream_path}.", code="unsupported_by_backend")
    again = resume.plan(payload, upstream_path, scope["headers"], candidates) if form is None else None
    await forward(scope, watch, send, path=path, body=body, candidates=candidates, ctx=ctx,
                  started=started, upstream_path=upstream_path, form=form, resume=again)

