"""The inference proxy: one OpenAI-compatible endpoint in front of every READY backend.

A raw ASGI app mounted ahead of Django for `/v1/`, `/api/inference/` and `/metrics`
(Django's handler would add 2-2.5 ms and cap the process near 250 req/s). The same core
(`open_upstream` in upstream.py, `list_models` here) also serves the Ninja routes in
serving/inference_api.py.

Rules held here: one pooled HTTP/1.1 client per process (http1.py); chunks are forwarded as they arrive;
a client that disconnects cancels the upstream request; a backend that dies mid-stream ends
an SSE stream with an error event; every error is OpenAI-shaped JSON.

A key's limits are checked here before a request is forwarded (`admit_request`: allowed
models, rpm/tpm and token quotas through serving.proxy.limits), and every request is counted
(serving.usage) in memory, written in batches off this path.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass

from django.conf import settings

from accounts.credentials import Principal, authenticate
from accounts.errors import ErrorAnswer, error_body
from live.db import DatabaseUnavailable, run_db
from serving.adapters import ADAPTERS
from serving.fleet_metrics import render_fleet
from serving.proxy import anthropic, metrics, ondemand
from serving.proxy.errors import ProxyError
from serving.proxy.limits import limiter
from serving.proxy.replicas import Backend, Standby, routing_table
from serving.proxy.upstream import UpstreamReply, multipart_boundary, open_upstream, record_abandoned
from serving.usage import RequestContext, recorder

log = logging.getLogger("xgen.proxy")

PROXY_PREFIXES = ("/v1/", "/api/inference/", "/metrics")
INFERENCE_PREFIX = "/api/inference"

# Paths whose kind of model is fixed (after the /api/inference and /embedding prefixes are taken
# off): a named model of another type is refused, and without a `model` the kind picks one.
PATH_KINDS = {
    "/v1/chat/completions": "llm",
    "/v1/completions": "llm",
    "/v1/responses": "llm",
    "/v1/messages": "llm",
    "/v1/messages/count_tokens": "llm",
    "/v1/embeddings": "embedding",
    "/v1/rerank": "rerank",
    "/v1/reranking": "rerank",  # llama-server's alias of /v1/rerank
    "/v1/score": "rerank",
    "/rerank": "rerank",
    "/score": "rerank",
    "/infill": "llm",
    "/apply-template": "llm",
}
# The engines' own routes outside /v1/ that take a model, reachable as /api/inference/<route>.
ENGINE_ROUTES = frozenset({"tokenize", "detokenize", "apply-template", "infill", "rerank", "score", "pooling",
                           "classify"})
# A POST /v1/<path> is forwarded when some engine serves it as an inference route (the engines'
# allowlists, serving/adapters); each request then only to an engine that serves it.
FORWARDED_V1_ROUTES = frozenset(p for adapter in ADAPTERS.values() for p in adapter.inference_routes
                                if p.startswith("/v1/"))

REQUEST_ID_RE = re.compile(rb"[\x21-\x7e](?:[\x20-\x7e]{0,126}[\x21-\x7e])?")  # a caller's X-Request-ID
WATCH_AFTER_S = 0.05  # a forwarded exchange still running this long watches for the client leaving


@dataclass(frozen=True)
class Route:
    """What a proxy path asks for: the method, `models` / `model` / `forward`, the kind of model
    (None: any), whether it came by the explicit embedding prefix, and the backend's path."""

    method: str
    operation: str
    kind: str | None
    embedding_only: bool
    upstream_path: str = ""


# ---------------------------------------------------------------- routing
def resolve_route(path: str) -> Route:
    """The route for a proxy path; ProxyError 404 if unknown."""
    inference = path.startswith(INFERENCE_PREFIX + "/")
    rest = path[len(INFERENCE_PREFIX):] if inference else path
    embedding_only = rest.startswith("/embedding/v1/")
    if embedding_only:
        rest = rest[len("/embedding"):]
    if rest == "/v1/models":
        return Route("GET", "models", None, embedding_only)
    if rest.startswith("/v1/models/") and len(rest) > len("/v1/models/"):
        return Route("GET", "model", None, embedding_only)
    if embedding_only:
        if rest == "/v1/embeddings":
            return Route("POST", "forward", "embedding", True, rest)
    elif rest in FORWARDED_V1_ROUTES:
        return Route("POST", "forward", PATH_KINDS.get(rest), False, rest)
    elif inference and rest[1:] in ENGINE_ROUTES:
        return Route("POST", "forward", PATH_KINDS.get(rest), False, rest)
    raise ProxyError(404, f"Unknown inference path {path}.", code="not_found")


def resolve_operation(path: str) -> tuple[str, str, str | None, bool]:
    """(method, operation, kind, embedding_only) for a proxy path (resolve_route's older face)."""
    route = resolve_route(path)
    return route.method, route.operation, route.kind, route.embedding_only


def _standby_entry(group: list[Standby]) -> dict:
    first = group[0]
    loading = any(s.state != "IDLE" for s in group)
    return {
        "id": first.model_name, "object": "model", "created": min(s.created for s in group), "owned_by": "xgen",
        "type": first.type, "backend": first.backend, "node": first.node,
        "aliases": sorted({a for s in group for a in s.aliases}), "replicas": 0, "instances": [],
        "status": "loading" if loading else "idle", "policy": "on_demand",
    }


def _model_entry(backends: list[Backend]) -> dict:
    first = backends[0]
    return {
        "status": "ready",
        "policy": first.policy,
        "id": first.model_name,
        "object": "model",
        "created": min(b.created for b in backends),
        "owned_by": "xgen",
        "type": first.type,
        "backend": first.backend,
        "node": first.node,
        "aliases": sorted({a for b in backends for a in b.aliases}),
        "replicas": len(backends),
        "instances": [{"id": b.instance_id, "node": b.node, "backend": b.backend, "in_flight": b.in_flight}
                      for b in backends],
    }


async def list_models(*, kind: str | None = None, principal: Principal | None = None) -> dict:
    """Every READY model (one entry per served name, replicas listed) in OpenAI's list shape;
    for a key with allowed_models, only those."""
    snap = await routing_table.snapshot()
    entries = {name: _model_entry(group) for name, group in snap.by_name.items()}
    for name, group in snap.standby.items():  # on_demand models not READY: idle or loading
        entries.setdefault(name, _standby_entry(group))
    data = [
        entry for name, entry in sorted(entries.items())
        if (kind is None or entry["type"] == kind) and (principal is None or principal.may_use(name))
    ]
    return {"object": "list", "data": data}


async def get_model(name: str, *, kind: str | None = None, principal: Principal | None = None) -> dict:
    """One READY model by served name; ProxyError 404 model_not_found otherwise (also for a model
    the key may not use: it is not in the key's list)."""
    snap = await routing_table.snapshot()
    served = snap.served_name(name)
    group = snap.by_name.get(served)
    entry = _model_entry(group) if group else (
        _standby_entry(snap.standby[served]) if snap.standby.get(served) else None)
    if entry is None or (kind is not None and entry["type"] != kind) or (principal and not principal.may_use(served)):
        raise ProxyError(404, f"The model '{name}' does not exist or is not ready.", code="model_not_found")
    return entry


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


async def candidates_for(payload: dict, *, kind: str | None, principal: Principal | None = None) -> list[Backend]:
    """The READY replicas for the body's `model`, or for the path's kind when it names none
    (then only models the key may use)."""
    snap = await routing_table.snapshot()
    model = payload.get("model")
    if model is not None:
        if not isinstance(model, str) or not model:
            raise ProxyError(400, "`model` must be a non-empty string.", code="invalid_request")
        served = snap.served_name(model)
        if principal is not None and not principal.may_use(served):
            raise _not_allowed(model)
        group = snap.by_name.get(served)
        if group:
            return group
        standby = ondemand.needs_cold_start(snap, served)
        if standby:
            raise ColdStartNeeded(served, standby)
        if model in snap.known_names:
            raise ProxyError(503, f"No backend for '{model}' is ready yet.", code="no_backend")
        raise ProxyError(404, f"The model '{model}' does not exist or is not loaded.", code="model_not_found")
    group = snap.by_type.get(kind or "llm")
    if group and principal is not None and principal.allowed_models is not None:
        group = [b for b in group if principal.may_use(b.model_name)]
        if not group:
            raise ProxyError(403, f"This key may use only {', '.join(sorted(principal.allowed_models))}; "
                                  "name one as `model`.", code="model_not_allowed")
    if not group:
        raise ProxyError(503, f"No {kind or 'llm'} model is ready.", code="no_backend")
    return group


class ColdStartNeeded(ProxyError):
    """Every replica of the model is IDLE (or on its way up): a request starts one. Callers that
    do not start models answer it as it is (503 no_backend)."""

    def __init__(self, model: str, standby: list[Standby]) -> None:
        super().__init__(503, f"The model '{model}' is idle; it starts on a request.", code="no_backend",
                         headers=[(b"retry-after", b"5")])
        self.model = model
        self.standby = standby


async def ready_candidates(payload: dict, *, kind: str | None, principal: Principal | None, ctx: RequestContext,
                           waiting=None) -> list[Backend]:
    """candidates_for, with a cold start of an IDLE model waited for (X-XGEN-Cold-Start set).
    `waiting(start, task)` waits in its own way (a stream's keep-alive comments)."""
    try:
        return await candidates_for(payload, kind=kind, principal=principal)
    except ColdStartNeeded as need:
        if kind is not None and need.standby[0].type != kind:
            raise ProxyError(400, f"The model '{need.model}' is a {need.standby[0].type} model; this path needs "
                                  f"a{'n' if kind[0] in 'aeiou' else ''} {kind} model.",
                             code="model_type_mismatch") from None
        began = time.perf_counter()
        start, task = await ondemand.cold_start(need.model, need.standby)
        group = await (waiting(start, task) if waiting is not None else asyncio.shield(task))
        ctx.extra_headers.append((b"x-xgen-cold-start", f"{time.perf_counter() - began:.2f}".encode()))
        return group


def _not_allowed(model: str) -> ProxyError:
    return ProxyError(403, f"This API key may not use the model '{model}'.", code="model_not_allowed")


async def admit_request(ctx: RequestContext, payload: dict, body: bytes, *, operation: str) -> bytes:
    """Before forwarding: the key's allowed models and limits (ProxyError 403 / 429), and, for a
    stream, usage asked of the backend when the client did not ask (the proxy counts tokens from
    it and drops that chunk before the client sees it). Returns the body to forward."""
    p = ctx.principal
    model = payload.get("model")
    ctx.model = model[:255] if isinstance(model, str) else ""
    ctx.stream = payload.get("stream") is True
    if p is not None:
        if isinstance(model, str) and model and not p.may_use(model):
            raise _not_allowed(model)
        if p.limited:
            verdict = await limiter().admit(p)
            if not verdict.allowed:
                raise ProxyError(429, verdict.message(p), code=verdict.code, headers=verdict.headers)
            ctx.rate_headers = verdict.headers
    if ctx.stream and operation in ("chat", "completions"):
        options = payload.get("stream_options")
        ctx.usage_asked = isinstance(options, dict) and options.get("include_usage") is True
        if not ctx.usage_asked:
            # Only a body without the member takes it as bytes: one with `"stream_options": null`
            # (or anything else) would end up with the key twice.
            added = None if "stream_options" in payload else _with_member(body, INCLUDE_USAGE)
            payload["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
            ctx.drop_usage_chunk = True
            body = added or json.dumps(payload).encode()
    return body


INCLUDE_USAGE = b'"stream_options":{"include_usage":true}'
JSON_SPACE = b" \t\r\n"


def _with_member(body: bytes, member: bytes) -> bytes | None:
    """`body`, a UTF-8 JSON object with at least one member, with `member` added before its closing
    brace: the caller's bytes pass as they came, without re-serialising a long prompt (json.dumps
    of a 208 KB chat body cost 434 us here, this 10 us). None when the body is not plainly such an object
    (another encoding, a BOM): the caller re-serialises then."""
    end = len(body) - 1
    while end > 0 and body[end] in JSON_SPACE:
        end -= 1
    start = 0
    while start < end and body[start] in JSON_SPACE:
        start += 1
    if body[start:start + 1] != b"{" or body[end:end + 1] != b"}":
        return None
    return b"".join((body[:end], b",", member, body[end:]))


async def peek_headers(principal: Principal | None) -> list[tuple[bytes, bytes]]:
    """The x-ratelimit-* headers of a limited key, without counting a request."""
    if principal is None or not (principal.rpm or principal.tpm):
        return []
    return (await limiter().admit(principal, cost=0)).headers


def client_request_id(headers: dict[bytes, bytes]) -> str:
    """The caller's own X-Request-ID ('' when it sent none): kept in the request log and echoed
    back, never sent to a backend (the console's own id goes there: llama-cpp-python answers 400
    to an id that is not a UUID). ProxyError 400 for one that is not 1-128 printable ASCII characters."""
    sent = headers.get(b"x-request-id")
    if not sent:  # none, or an empty one (as before: some gateways send the header empty)
        return ""
    if not REQUEST_ID_RE.fullmatch(sent):
        raise ProxyError(400, "X-Request-ID must be 1 to 128 printable ASCII characters (no spaces at its ends).",
                         code="invalid_request_id")
    return sent.decode("ascii")


def new_request_id() -> str:
    """A UUIDv7 (RFC 9562) in 32 hex digits: unique, and ordered by time (milliseconds), so the
    request log's request_id index grows at its end. Random ids (uuid4) land anywhere in it: at
    250,000 rows an insert cost 28.5 us against 10.2 us for ordered ones (SQLite), and worse as
    the log grows."""
    rand = int.from_bytes(os.urandom(10), "big")
    value = ((time.time_ns() // 1_000_000) & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | (rand >> 68) << 64 \
        | 0b10 << 62 | (rand & ((1 << 62) - 1))
    return f"{value:032x}"


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
    asyncio.current_task().uncancel()
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


# ---------------------------------------------------------------- timing
def server_timing(started: float, reply: UpstreamReply | None = None, *, excluded_s: float = 0.0
                  ) -> tuple[bytes, bytes]:
    """`Server-Timing: proxy;dur=<ms in the console>, upstream;dur=<ms to the backend's first byte>`
    (the upstream figure only once a backend answered); both figures also go to /metrics.
    `excluded_s` is time after the backend's headers that was the backend's, not ours (reading a
    whole small body before answering)."""
    total = time.perf_counter() - started - excluded_s
    if reply is None:
        return b"server-timing", f"proxy;dur={1000 * total:.1f}".encode()
    upstream = reply.first_byte_s
    proxy = max(0.0, total - upstream)
    metrics.record_timing(model=reply.backend.model_name, instance_id=reply.backend.instance_id,
                          proxy_s=proxy, upstream_s=upstream)
    return b"server-timing", f"proxy;dur={1000 * proxy:.1f}, upstream;dur={1000 * upstream:.1f}".encode()


# ---------------------------------------------------------------- request bodies
# The media types a body may come as (an allowlist, matched lower-cased: llama-server matches
# case-sensitively and read a JSON body sent as `Multipart/form-data` as JSON while the proxy took
# it for a form). All but a form are read as JSON and sent on as application/json
# (upstream.forwarded_content_type), so the console and the engine read one body alike.
JSON_MEDIA_TYPES = frozenset({
    b"",  # none given: JSON, as the OpenAI SDKs send
    b"application/json",
    b"application/x-www-form-urlencoded",  # what `curl -d` labels the JSON it sends
})
MULTIPART_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})  # the routes taking a form
# A Content-Disposition parameter, its value a quoted string (one holding `;name=` is not read as two) or a token.
DISPOSITION_PARAM_RE = re.compile(rb';\s*([!#$%&\'*+.^_`|~0-9A-Za-z-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;\s]*))')


def media_type(headers: dict[bytes, bytes]) -> tuple[bytes, bytes]:
    """(the lower-cased media type, its parameters) of the request's Content-Type."""
    media, _, params = headers.get(b"content-type", b"").partition(b";")
    return media.strip().lower(), params


def request_payload(body: bytes, headers: dict[bytes, bytes], *, path: str = "") -> dict:
    """What routing reads of a body: the JSON object, or the `model` field of a multipart form on
    the routes that take one (`path`, the backend's); 415 for a media type the proxy does not read
    (or a form elsewhere), 400 for a body that is not what its type says."""
    media, params = media_type(headers)
    if media == b"multipart/form-data":
        if path not in MULTIPART_PATHS:
            raise ProxyError(415, f"{path or 'This route'} takes a JSON body (Content-Type: application/json), "
                                  "not a multipart form.", code="unsupported_media_type")
        return multipart_model(body, params)
    if media not in JSON_MEDIA_TYPES or _param(params, b"charset") not in (None, b"utf-8", b"utf8"):
        forms = " or a multipart form" if path in MULTIPART_PATHS else ""
        raise ProxyError(415, f"Content-Type {headers.get(b'content-type', b'').decode('latin-1')[:100]!r} is not "
                              f"accepted; send JSON (application/json, UTF-8){forms}.", code="unsupported_media_type")
    if json.detect_encoding(body) not in ("utf-8", "utf-8-sig"):
        raise ProxyError(400, "The request body is JSON in another encoding than UTF-8.", code="invalid_json")
    try:
        return parse_body(body)
    except ProxyError:
        if media == b"application/x-www-form-urlencoded":
            raise ProxyError(415, "The body is labelled a form (application/x-www-form-urlencoded) and is not "
                                  "a JSON object; send JSON with Content-Type: application/json.",
                             code="unsupported_media_type") from None
        raise


def _param(params: bytes, name: bytes) -> bytes | None:
    """A Content-Type parameter's value, lower-cased and unquoted; None when absent."""
    for param in params.split(b";"):
        key, sep, value = param.partition(b"=")
        if sep and key.strip().lower() == name:
            return value.strip().strip(b'"').lower()
    return None


def _form_name(disposition: bytes) -> bytes | None:
    """The `name` parameter of a part's Content-Disposition (`form-data; name="model"`)."""
    for param in DISPOSITION_PARAM_RE.finditer(disposition):
        if param.group(1).lower() == b"name":
            return re.sub(rb"\\(.)", rb"\1", param.group(2)) if param.group(2) is not None else param.group(3)
    return None


def multipart_model(body: bytes, params: bytes) -> dict:
    """The `model` field of a multipart form (form_model_span): {"model": ...}, or {} without one."""
    span = form_model_span(body, params)
    if span is None:
        return {}
    try:
        return {"model": body[span[0]:span[1]].decode("utf-8")}
    except UnicodeDecodeError:
        raise ProxyError(400, "The form's `model` field is not UTF-8.", code="invalid_request") from None


def form_model_span(body: bytes, params: bytes) -> tuple[int, int] | None:
    """Where the `model` field's value sits in a multipart form, found as a form parser finds it:
    parts between the boundary lines that the Content-Type names, a part's headers up to its blank
    line; 400 for a body that is not such a form, or names `model` twice."""
    boundary = multipart_boundary(params)
    if boundary is None:
        raise ProxyError(400, "A multipart Content-Type needs a valid boundary parameter.", code="invalid_request")
    delimiter = b"--" + boundary
    if not body.startswith(delimiter + b"\r\n"):
        raise ProxyError(400, "The body is not the multipart form its Content-Type says (it does not start with "
                              "its boundary line).", code="invalid_request")
    found: list[tuple[int, int]] = []
    pos = len(delimiter) + 2
    separator = b"\r\n" + delimiter
    while True:
        end = body.find(separator, pos)
        if end < 0:
            raise ProxyError(400, "The multipart form ends without its closing boundary.", code="invalid_request")
        head_end = body.find(b"\r\n\r\n", pos, end)
        head = body[pos:head_end] if head_end >= 0 else b""
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-disposition" and _form_name(value) == b"model":
                found.append((head_end + 4, end))
        after = body[end + len(separator):end + len(separator) + 2]
        if after == b"--":
            break
        if after != b"\r\n":
            raise ProxyError(400, "The multipart form has a malformed boundary line.", code="invalid_request")
        pos = end + len(separator) + 2
    if len(found) > 1:
        raise ProxyError(400, "The form names `model` more than once.", code="invalid_request")
    return found[0] if found else None


async def resolve_alias(payload: dict, body: bytes, *, form: bytes | None = None) -> tuple[dict, bytes]:
    """A `model` that is an alias stands for its served name: the body is rewritten to name it
    (backends such as vLLM check the name): the JSON object, or the `model` field of a multipart
    form (`form`: its Content-Type's parameters)."""
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        return payload, body
    snap = await routing_table.snapshot()
    name = snap.served_name(model)
    if name == model:
        return payload, body
    if form is not None:  # only the form's model field was read: it alone is replaced
        start, end = form_model_span(body, form)
        return {"model": name}, body[:start] + name.encode() + body[end:]
    payload = {**payload, "model": name}
    return payload, json.dumps(payload).encode()


def check_model_type(candidates: list[Backend], route: Route, payload: dict) -> None:
    """Type rules: chat, completions, responses and messages only to LLMs, embeddings only to
    embedding models, rerank and score only to rerank models; ProxyError 400 `model_type_mismatch`
    for a named model of another type."""
    if route.kind is None or not candidates or candidates[0].type == route.kind:
        return
    name = payload.get("model") or candidates[0].model_name
    has, needs = (f"a{'n' if kind[0] in 'aeiou' else ''} {kind}" for kind in (candidates[0].type, route.kind))
    raise ProxyError(400, f"The model '{name}' is {has} model; {route.upstream_path} needs {needs} model.",
                     code="model_type_mismatch")


def usage_operation(upstream_path: str) -> str:
    """What admit_request needs of a route: `chat` and `completions` get usage asked of a stream."""
    return {"/v1/chat/completions": "chat", "/v1/completions": "completions",
            "/v1/embeddings": "embeddings"}.get(upstream_path, "forward")


def backend_serves(backend: Backend, path: str) -> bool:
    """Whether the backend kind answers `path` itself (its adapter knows); unknown kinds pass."""
    adapter = ADAPTERS.get(backend.backend)
    return adapter is None or adapter.serves(path)


async def _handle(scope, receive, send, headers: dict[bytes, bytes], ctx: RequestContext, started: float) -> None:
    path: str = scope["path"]
    method: str = scope["method"]
    headers = anthropic.with_api_key_auth(headers)
    if path == "/metrics" or path == "/metrics/":
        if method != "GET":
            raise ProxyError(405, "Use GET.", code="method_not_allowed", headers=[(b"allow", b"GET")])
        reader = await authenticate(headers, method=method, scheme=scope.get("scheme", "http"), scope="read")
        body, content_type = metrics.render_metrics()
        try:  # the dashboard's DB-backed families, rendered in a worker thread, never on the loop
            body += await run_db(render_fleet)
        except DatabaseUnavailable:
            log.warning("/metrics: the database is unreachable; only this process's counters are exported")
        if reader.allowed_models is not None:  # a key limited to some models reads theirs only
            body = metrics.only_models(body, reader.allowed_models)
        await _send_json(send, 200, body, content_type=content_type.encode())
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
    payload = request_payload(body, headers, path=route.upstream_path)
    media, params = media_type(headers)
    payload, body = await resolve_alias(payload, body, form=params if media == b"multipart/form-data" else None)
    ctx.principal = principal  # from here on, the request is in the request log
    body = await admit_request(ctx, payload, body, operation=usage_operation(route.upstream_path))
    try:
        candidates = await candidates_for(payload, kind=route.kind, principal=principal)
    except ColdStartNeeded:
        # Waited for inside _forward, where a client that leaves is noticed (and leaves the wait).
        candidates = await _cold_candidates(scope, receive, send, payload, route, ctx)
        if candidates is None:
            return
        if ctx.comments_sent:
            send = _AfterComments(send)
    check_model_type(candidates, route, payload)
    upstream_path = route.upstream_path
    if anthropic.is_messages_path(upstream_path):
        if not backend_serves(candidates[0], upstream_path):
            translation = anthropic.Translation(payload, count_only=upstream_path.endswith("/count_tokens"))
            ctx.usage_asked = translation.stream  # its chat stream asks usage for the message_delta
            await _forward(scope, receive, send, path=path, body=translation.chat_body(), candidates=candidates,
                           ctx=ctx, started=started, upstream_path="/v1/chat/completions",
                           relay=translation.relay)
            return
        await _forward(scope, receive, send, path=path, body=body, candidates=candidates, ctx=ctx,
                       started=started, upstream_path=upstream_path, shape_error=anthropic.backend_error)
        return
    if not backend_serves(candidates[0], upstream_path):
        label = getattr(ADAPTERS.get(candidates[0].backend), "label", candidates[0].backend)
        raise ProxyError(404, f"{label} (the backend serving '{candidates[0].model_name}') does not serve "
                              f"{upstream_path}.", code="unsupported_by_backend")
    await _forward(scope, receive, send, path=path, body=body, candidates=candidates, ctx=ctx,
                   started=started, upstream_path=upstream_path)


# ---------------------------------------------------------------- answering
ERROR_READ_MAX = 65536  # of a backend's non-JSON error page, as much is read to quote it


def openai_error_for(status: int, data: bytes, content_type: str) -> bytes | None:
    """A backend's error answer in the OpenAI shape: None keeps one that already has it; a plain
    text or HTML page, or JSON of another shape (FastAPI's `{"detail": ...}`), is rewritten with
    the backend's own words as the message."""
    message = ""
    if content_type.endswith("json"):
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            body = None
        if isinstance(body, dict):
            if isinstance(body.get("error"), dict):
                return None
            detail = body.get("detail") or body.get("message") or body.get("error")
            message = detail if isinstance(detail, str) else json.dumps(detail) if detail else ""
    if not message:
        text = re.sub(r"<[^>]+>", " ", data[:2000].decode("utf-8", "replace"))
        message = " ".join(text.split())
    message = message[:500] or f"The backend answered {status}."
    return json.dumps(error_body(message, status=status, code="not_found" if status == 404 else "upstream_error")
                      ).encode()


async def passthrough(reply: UpstreamReply, send, timing, *, shape_error=openai_error_for) -> None:
    """The backend's answer as it came: status, headers, body chunk by chunk (an error page that
    is not JSON rewritten by `shape_error`)."""
    if reply.status >= 400 and not reply.is_sse:
        parts, size = [], 0
        read_from = time.perf_counter()
        async with contextlib.aclosing(reply.chunks()) as stream:
            async for chunk in stream:
                parts.append(chunk)
                size += len(chunk)
                if size > ERROR_READ_MAX:
                    reply.finish()  # the backend's error, counted as its status (not a client that left)
                    break
        data = b"".join(parts)
        fixed = shape_error(reply.status, data, reply.response.content_type)
        headers = reply.headers()
        if fixed is not None:
            data = fixed
            drop = {b"content-type", b"content-length", b"content-encoding"}
            headers = [(k, v) for k, v in headers if k not in drop]
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        elif size > ERROR_READ_MAX:
            headers = [(k, v) for k, v in headers if k != b"content-length"]
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": [*headers, timing(time.perf_counter() - read_from)]})
        await send({"type": "http.response.body", "body": data})
        return
    if reply.whole_body_size() is not None:
        read_from = time.perf_counter()
        data = await reply.read_whole()
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": [*reply.headers(), timing(time.perf_counter() - read_from)]})
        await send({"type": "http.response.body", "body": data})
        return
    await send({"type": "http.response.start", "status": reply.status, "headers": [*reply.headers(), timing(0.0)]})
    ended = False
    async with contextlib.aclosing(reply.chunks()) as stream:
        async for chunk in stream:  # read to its end even after the last chunk: that counts its usage
            if not ended:
                ended = reply.last_chunk  # nothing can follow: the body and its end in one write
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
    if not ended:
        # A JSON body the backend cut off ends here too: daphne would hang on an unfinished
        # response, and the truncated JSON already tells the client it is broken.
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _cold_candidates(scope, receive, send, payload: dict, route: Route, ctx: RequestContext
                           ) -> list[Backend] | None:
    """Wait for a cold start, watching for the client leaving (None: it left, or its stream was
    answered with the failure). A stream gets `: loading N%` comments while it waits."""
    current = asyncio.current_task()
    flags = {"gone": False, "sse": False}

    async def watch_disconnect() -> None:
        message = await receive()
        if message["type"] == "http.disconnect":
            flags["gone"] = True
            current.cancel()

    async def keepalive(start: ondemand.ColdStart, task: asyncio.Task) -> list[Backend]:
        every = settings.COLD_START_KEEPALIVE_S
        done, _ = await asyncio.wait({task}, timeout=every)
        while not done:
            if not flags["sse"]:
                flags["sse"] = ctx.comments_sent = True
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                    (b"x-request-id", ctx.answer_request_id.encode()),
                    (b"x-xgen-cold-start", f"{time.perf_counter() - start.began:.2f}".encode())]})
            await send({"type": "http.response.body", "body": f": loading {start.pct}%\n\n".encode(),
                        "more_body": True})
            done, _ = await asyncio.wait({task}, timeout=max(every, 0.5))
        return task.result()

    watcher = asyncio.create_task(watch_disconnect())
    try:
        return await ready_candidates(payload, kind=route.kind, principal=ctx.principal, ctx=ctx,
                                      waiting=keepalive if ctx.stream else None)
    except asyncio.CancelledError:
        if not flags["gone"]:
            raise
        current.uncancel()  # the client left: the start goes on for the next request, nothing else stays
        recorder.record_refused(ctx, status=metrics.CLIENT_GONE, code="client_gone")  # no backend saw it
        return None
    except ErrorAnswer as exc:
        if not flags["sse"]:
            raise
        metrics.record_rejected(exc.code or str(exc.status))
        recorder.record_refused(ctx, status=exc.status, code=exc.code)
        await send({"type": "http.response.body", "body": b"data: " + exc.body() + b"\n\n", "more_body": False})
        return None
    finally:
        watcher.cancel()


class _AfterComments:
    """`send` for an answer whose SSE headers went out with the loading comments: the backend's
    own response start is not sent again."""

    def __init__(self, send) -> None:
        self.send = send

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            return
        await self.send(message)


async def _forward(scope, receive, send, *, path: str, body: bytes, candidates: list[Backend],
                   ctx: RequestContext, started: float | None = None, upstream_path: str | None = None,
                   relay=None, shape_error=openai_error_for) -> None:
    """Open the upstream request and answer through `relay` (by default `passthrough`), watching
    for the client leaving."""
    current = asyncio.current_task()
    flags = {"gone": False, "done": False}
    started = time.perf_counter() if started is None else started

    async def watch_disconnect() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not flags["done"]:
                    flags["gone"] = True
                    current.cancel()
                return

    # The watch starts only when the exchange outlasts WATCH_AFTER_S: most answers are done
    # sooner, and a task a request cost ~7 us of CPU. A stream, or a backend slow to answer,
    # is watched from then on (uvicorn and daphne drop what is sent to a client that left, so
    # nothing but this watch would stop the upstream request).
    watcher: asyncio.Task | None = None

    def start_watching() -> None:
        nonlocal watcher
        if not flags["done"]:
            watcher = asyncio.create_task(watch_disconnect())

    timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, start_watching)
    reply: UpstreamReply | None = None
    slot = ondemand.NO_SLOT
    sent = False  # the request went to a backend (past the max_concurrency queue)
    sent_path = upstream_path or path
    try:
        # max_concurrency: wait for a slot here, where a client that leaves is noticed.
        slot = await ondemand.admit(candidates[0].model_name, candidates, _priority(ctx),
                                    ondemand.queue_owner(ctx.principal, ctx.client))
        sent = True
        reply = await open_upstream(path=path, query=scope.get("query_string", b""), body=body,
                                    candidates=candidates, headers=scope["headers"], request_id=ctx.request_id,
                                    upstream_path=upstream_path, ctx=ctx)
        reply.upstream_path, reply.body = sent_path, body  # what the usage reader and a prompt count go by
        ondemand.activity.touch(reply.backend)

        def timing(excluded_s: float = 0.0) -> tuple[bytes, bytes]:
            return server_timing(started, reply, excluded_s=excluded_s)

        if relay is None:
            await passthrough(reply, send, timing, shape_error=shape_error)
        else:
            await relay(reply, send, timing)
        flags["done"] = True
    except asyncio.CancelledError:
        if not flags["gone"]:
            raise
        current.uncancel()  # the client left: not an error, just stop
        if reply is None:  # before a backend's first byte: a 499 in the log, billed what the engine got
            record_abandoned(ctx, candidates, sent_path, body, sent=sent)
    except OSError:
        pass  # the server could not write to a client that went away
    finally:
        flags["done"] = True
        timer.cancel()
        if watcher is not None:
            watcher.cancel()
        if reply is not None:
            reply.abort()
        slot.release()


def _priority(ctx: RequestContext) -> int:
    """The queue priority of the request's key (a browser session is normal)."""
    p = ctx.principal
    return int(p.priority) if p is not None and p.key_id else 4
