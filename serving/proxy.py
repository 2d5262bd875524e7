"""The inference proxy: one OpenAI-compatible endpoint in front of every READY backend.

A raw ASGI app mounted ahead of Django for `/v1/`, `/api/inference/` and `/metrics`
(Django's handler would add 2-2.5 ms and cap the process near 250 req/s). The same core
(`open_upstream`, `list_models`) also serves the Ninja routes in serving/inference_api.py.

Rules held here: one pooled aiohttp session per process; chunks are forwarded as they arrive;
a client that disconnects cancels the upstream request; a backend that dies mid-stream ends
an SSE stream with an error event; every error is OpenAI-shaped JSON.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http.cookies import SimpleCookie

import aiohttp
from django.conf import settings
from django.contrib.auth.signals import user_logged_out

from serving import metrics
from serving.routing_table import Backend, routing_table
from xgenconsole.auth import Principal, PrincipalCache, alookup_key, key_cache
from xgenconsole.db import DatabaseUnavailable, db_async
from xgenconsole.errors import error_body
from xgenconsole.models import hash_key

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

# Never forwarded to a backend: hop-by-hop headers, our own auth and session, and what aiohttp sets.
DROP_REQUEST_HEADERS = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
    b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host", b"authorization",
    b"cookie", b"content-length", b"x-csrftoken", b"x-request-id", b"expect",
})
DROP_RESPONSE_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
    "trailer", "trailers", "transfer-encoding", "upgrade", "date", "server", "x-request-id", "set-cookie",
})
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
USAGE_RE = re.compile(rb'"(prompt_tokens|completion_tokens)"\s*:\s*(\d+)')
USAGE_TAIL = 4096  # usage sits at the end of a JSON answer and in a stream's last chunks
WHOLE_BODY_MAX = 1 << 20  # answers up to this size with a Content-Length go out in one message
SESSION_CACHE_S = 5.0


class ProxyError(Exception):
    """An answer the proxy gives itself, in the OpenAI error shape."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or []

    def body(self) -> bytes:
        return json.dumps(error_body(self.message, status=self.status, code=self.code)).encode()


# ---------------------------------------------------------------- the pooled client
_client: aiohttp.ClientSession | None = None
_client_loop: asyncio.AbstractEventLoop | None = None


def client() -> aiohttp.ClientSession:
    """The process's one pooled HTTP client, created lazily in the running loop."""
    global _client, _client_loop
    loop = asyncio.get_running_loop()
    if _client is None or _client.closed or _client_loop is not loop:
        _client_loop = loop
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=60)
        _client = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.PROXY_CONNECT_TIMEOUT_S,
                                          sock_read=None),
            auto_decompress=False,  # bytes pass through as the backend encoded them
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
            raise_for_status=False,
        )
    return _client


async def shutdown_proxy() -> None:
    """Close the pooled client (lifespan shutdown or process exit)."""
    global _client
    if _client is not None and not _client.closed:
        try:
            await _client.close()
        except RuntimeError:  # created in a loop that is gone
            pass
    _client = None


# ---------------------------------------------------------------- auth
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
    """A bearer key (cached, no database per request) or the console's session (+CSRF on writes)."""
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
            raise ProxyError(401, "Invalid API key.", code="invalid_api_key",
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
                        raise ProxyError(403, "Origin checking failed for this session request.",
                                         code="csrf_failed")
                    if not _csrf_ok(headers, cookies):
                        raise ProxyError(403, "CSRF token missing or incorrect: send the X-CSRFToken header.",
                                         code="csrf_failed")
                return principal
    raise ProxyError(401, "Authentication required: send 'Authorization: Bearer <key>' or sign in.",
                     code="unauthorized", headers=[(b"www-authenticate", b"Bearer")])


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


# ---------------------------------------------------------------- one upstream exchange
@dataclass(eq=False)
class UpstreamReply:
    """An open backend response: status and headers now, the body chunk by chunk."""

    backend: Backend
    response: aiohttp.ClientResponse
    started: float
    first_byte_s: float
    request_id: str
    _finished: bool = False

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def is_sse(self) -> bool:
        return self.response.content_type == "text/event-stream"

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers for the client: hop-by-hop dropped, the request id added."""
        out = [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in self.response.headers.items()
            if k.lower() not in DROP_RESPONSE_HEADERS
        ]
        out.append((b"x-request-id", self.request_id.encode()))
        return out

    def whole_body_size(self) -> int | None:
        """The Content-Length when the answer is small enough to send in one message."""
        length = self.response.content_length
        if length is not None and length <= WHOLE_BODY_MAX and not self.is_sse:
            return length
        return None

    async def read_whole(self) -> bytes:
        """The whole (small, non-streaming) body; ProxyError 502 when the backend breaks off."""
        try:
            body = await self.response.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self.finish(error="upstream_broken")
            raise ProxyError(502, f"The backend broke off its answer: {exc}", code="upstream_error") from None
        except BaseException:
            self.finish(error=None, cancelled=True)
            raise
        self.finish(tail=body[-USAGE_TAIL:])
        return body

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as the backend sends it; an SSE stream that breaks ends with an error event.

        An SSE stream goes out in whole events: bytes after the last event boundary wait for the
        rest of their event, so a stream cut mid-event never glues its error event to half an event.
        """
        tail = b""
        sse = self.is_sse
        clean = False
        partial = b""
        try:
            async for chunk in self.response.content.iter_any():
                tail = chunk[-USAGE_TAIL:] if len(chunk) >= USAGE_TAIL else (tail + chunk)[-USAGE_TAIL:]
                if sse:
                    chunk = partial + chunk
                    end = _event_end(chunk)
                    chunk, partial = chunk[:end], chunk[end:]
                    if not chunk:
                        continue
                yield chunk
            clean = True
            if partial:
                yield partial  # a last event without its blank line: the backend's own framing
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            if sse and not partial and tail.rstrip().endswith(b"data: [DONE]"):
                clean = True  # cut after its last event: the answer is whole, the lost framing is not news
                return
            log.warning("backend %s broke off request %s: %s", self.backend.base_url, self.request_id, exc)
            self.finish(error="upstream_broken")
            if sse:
                err = error_body(f"The backend stopped before finishing this answer ({exc.__class__.__name__}).",
                                 status=502, code="upstream_error")
                yield b"data: " + json.dumps(err).encode() + b"\n\n"
        finally:
            if clean:
                self.finish(tail=tail)
            else:
                self.finish(error=None, cancelled=True)

    def finish(self, *, tail: bytes = b"", error: str | None = None, cancelled: bool = False) -> None:
        """Release the connection (closed unless fully read), count the request; idempotent."""
        if self._finished:
            return
        self._finished = True
        self.backend.in_flight -= 1
        if error is None and not cancelled:
            self.response.release()
        else:
            self.response.close()
        tokens = {}
        if tail and self.status < 400:
            for kind, value in USAGE_RE.findall(tail):
                tokens[kind] = int(value)  # the last occurrence wins (a stream's final chunk)
        metrics.record(
            model=self.backend.model_name, instance_id=self.backend.instance_id,
            status=metrics.CLIENT_GONE if cancelled else self.status,
            duration_s=time.perf_counter() - self.started, first_byte_s=self.first_byte_s,
            prompt_tokens=tokens.get(b"prompt_tokens", 0), completion_tokens=tokens.get(b"completion_tokens", 0),
            error=error,
        )

    def abort(self) -> None:
        """Close the upstream connection now (the client went away)."""
        self.finish(cancelled=True)


def _event_end(data: bytes) -> int:
    """Where the last complete SSE event in `data` ends (0 when none does)."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def forward_headers(raw: list[tuple[bytes, bytes]], request_id: str) -> list[tuple[str, str]]:
    """The caller's headers minus hop-by-hop, Host, auth and cookies; plus X-Request-ID."""
    drop = DROP_REQUEST_HEADERS
    for name, value in raw:
        if name == b"connection":  # headers it lists are hop-by-hop too
            drop = drop | {token.strip().lower() for token in value.split(b",")}
    out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw if k.lower() not in drop]
    out.append(("X-Request-ID", request_id))
    return out


async def open_upstream(*, path: str, query: bytes, body: bytes, candidates: list[Backend],
                        headers: list[tuple[bytes, bytes]], request_id: str) -> UpstreamReply:
    """Send the request to the least busy replica (the next one if it refuses); return at headers."""
    upstream_path = path[path.index("/v1/"):]
    suffix = "?" + query.decode("latin-1") if query else ""
    fwd = forward_headers(headers, request_id)
    session = client()
    last_exc: Exception | None = None
    attempts = routing_table.order(candidates)
    retried: set[int] = set()
    while attempts:
        backend = attempts.pop(0)
        backend.in_flight += 1
        started = time.perf_counter()
        try:
            response = await session.post(backend.base_url + upstream_path + suffix, data=body, headers=fwd)
        except aiohttp.ClientConnectorError as exc:
            # Refused before a byte was sent: this replica is gone, try the next.
            backend.in_flight -= 1
            backend.mark_down()
            last_exc = exc
            metrics.record(model=backend.model_name, instance_id=backend.instance_id, status=502,
                           duration_s=time.perf_counter() - started, first_byte_s=None, error="connect")
            continue
        except aiohttp.ServerDisconnectedError as exc:
            # Closed before answering; most often a pooled connection to a backend that restarted:
            # one more try on a fresh connection tells a restart from a dead replica.
            backend.in_flight -= 1
            last_exc = exc
            if id(backend) not in retried:
                retried.add(id(backend))
                attempts.insert(0, backend)
            else:
                backend.mark_down()
                metrics.record(model=backend.model_name, instance_id=backend.instance_id, status=502,
                               duration_s=time.perf_counter() - started, first_byte_s=None, error="connect")
            continue
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            backend.in_flight -= 1
            metrics.record(model=backend.model_name, instance_id=backend.instance_id, status=502,
                           duration_s=time.perf_counter() - started, first_byte_s=None, error="upstream")
            raise ProxyError(502, f"The backend failed before answering: {exc.__class__.__name__}: {exc}",
                             code="upstream_error") from None
        except BaseException:
            backend.in_flight -= 1
            raise
        backend.down_until = 0.0
        return UpstreamReply(backend=backend, response=response, started=started,
                             first_byte_s=time.perf_counter() - started, request_id=request_id)
    names = ", ".join(sorted({b.model_name for b in candidates}))
    raise ProxyError(502, f"No backend for {names} accepted the connection ({last_exc}).",
                     code="upstream_unreachable")


# ---------------------------------------------------------------- the ASGI app
async def _read_body(receive, headers: dict[bytes, bytes]) -> bytes | None:
    """The request body, bounded by PROXY_MAX_BODY_BYTES; None when the client left."""
    limit = settings.PROXY_MAX_BODY_BYTES
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
    except ProxyError as exc:
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

    body = await _read_body(receive, headers)
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
