"""The upstream side of the proxy: one pooled HTTP/1.1 client per process (serving.proxy.http1),
sending a request to the least busy replica and passing its answer through chunk by chunk (SSE in whole events).
When an exchange finishes, its usage is counted (serving.proxy.usage) and its tokens charged to the
key's limits (serving.proxy.limits), in memory: nothing here waits for the database."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from django.conf import settings

from accounts.errors import error_body
from serving.proxy import http1, metrics, ondemand, usage_reader
from serving.proxy.cluster_admission import shutdown_cluster_admission
from serving.proxy.errors import ProxyError
from serving.proxy.limits import limiter, shutdown_limiter
from serving.proxy.replicas import Backend, routing_table
from serving.proxy.usage import RequestContext, recorder

log = logging.getLogger("xgen.proxy")

# What of a caller's request reaches a backend: these headers only (an allowlist: a header the
# console does not know may change what an engine does; llama-server's X-Conversation-Id made a
# stream outlive its client and let another key end it), each for its reason. Everything else
# stays here: hop-by-hop headers, Host, the caller's credentials and cookies (the console's own
# auth), X-Request-ID (the console sends its own), Accept-Encoding (the proxy reads usage and SSE
# events out of the answers: they must come uncompressed), X-Conversation-Id, anything custom.
FORWARD_REQUEST_HEADERS: dict[bytes, str] = {
    b"accept": "what the client takes (JSON or text/event-stream); the engines may choose by it",
    b"traceparent": "W3C trace context: a trace goes on through the engine (vLLM's OpenTelemetry)",
    b"tracestate": "W3C trace context, with traceparent",
    b"anthropic-version": "the Messages API version the client speaks (llama-server, vLLM serve /v1/messages)",
    b"anthropic-beta": "the Messages API features the client asks for",
    b"openai-beta": "the OpenAI API beta features the client asks for (Responses, Assistants)",
}
# Set by the proxy itself: content-type (the one the body was parsed by, from request_payload's
# reading: forwarded_content_type), content-length and host (http1.py), x-request-id (the console's own id).
# What of a backend's answer reaches the client: these headers (an allowlist: a backend's own
# Set-Cookie, Server, its Access-Control-* that echo any Origin, its request id, hop-by-hop and
# whatever an engine adds stay here), each for its reason.
FORWARD_RESPONSE_HEADERS: dict[bytes, str] = {
    b"content-type": "what the body is (JSON, SSE, audio...)",
    b"content-length": "the body's size (the relay drops it where it rewrites the body)",
    b"content-disposition": "the file name of a binary answer (audio/speech)",
    b"content-encoding": "a body a backend compressed anyway (the console never asks) stays readable",
    b"cache-control": "SSE streams say no-cache",
    b"x-accel-buffering": "tells a reverse proxy in front of the console not to buffer a stream",
    b"retry-after": "when a backend that refused (429, 503) takes requests again",
}
BODY_USAGE_MAX = 16 << 20  # of an answer streamed without a Content-Length, as much is kept to read its usage
COUNT_TIMEOUT_S = 120.0  # for the engine to count a prompt the console bills without the engine's figure
WHOLE_BODY_MAX = 1 << 20  # answers up to this size with a Content-Length go out in one message


# ---------------------------------------------------------------- the pooled client
_client: http1.Client | None = None
_client_loop: asyncio.AbstractEventLoop | None = None


def usage_model(ctx: RequestContext, backend: Backend) -> str:
    """The model a request's usage and log row name: `<model>:<adapter>` for a LoRA adapter of
    the backend's model (issue 27), else the served name."""
    if backend.adapters and ctx.model.startswith(backend.model_name + ":"):
        return ctx.model
    return backend.model_name


def client() -> http1.Client:
    """The process's one pooled HTTP client, created lazily in the running loop."""
    global _client, _client_loop
    loop = asyncio.get_running_loop()
    if _client is None or _client.closed or _client_loop is not loop:
        _client_loop = loop
        _client = http1.Client(connect_timeout_s=settings.PROXY_CONNECT_TIMEOUT_S,
                               first_byte_timeout_s=settings.PROXY_FIRST_BYTE_TIMEOUT_S,
                               idle_timeout_s=settings.PROXY_IDLE_TIMEOUT_S)
    return _client


async def shutdown_proxy() -> None:
    """Close the pooled client and stop the routing table's background refresh (lifespan
    shutdown or process exit)."""
    global _client
    from accounts.credentials import upkeep

    await drain_counts()  # requests waiting for the engine's count of their prompt are recorded first
    await routing_table.stop()
    await shutdown_limiter()
    await shutdown_cluster_admission()
    await ondemand.activity.stop()
    await recorder.stop()  # what was counted since the last write: nothing is lost on a graceful stop
    await upkeep.stop()
    if _client is not None and not _client.closed:
        try:
            await _client.close()
        except RuntimeError:  # created in a loop that is gone
            _client.closed = True
    _client = None


# ---------------------------------------------------------------- one upstream exchange
@dataclass(eq=False)
class UpstreamReply:
    """An open backend response: status and headers now, the body chunk by chunk."""

    backend: Backend
    response: http1.Response
    started: float
    first_byte_s: float
    request_id: str
    ctx: RequestContext | None = None
    busy_mark: float = 0.0
    first_chunk_s: float | None = None
    last_chunk: bool = False  # the chunk chunks() just yielded is the body's last
    # What was sent (set by the relay): the answer's shape, and what the engine counts when it
    # did not say how many prompt tokens it processed.
    upstream_path: str = ""
    body: bytes = b""
    reader: usage_reader.StreamReader | None = None  # an SSE stream's usage so far
    prompt_tokens: int | None = None  # what a whole (not SSE) answer said
    completion_tokens: int | None = None
    # A stream that may go on on another replica (serving.proxy.resume): when it breaks, chunks()
    # ends without its error event and without counting it, `broken` says why, and the relay
    # resumes or ends it. A resumed stream bills `billed_prompt` (the original request's prompt,
    # as the engine counts it) and `carried` completion tokens the broken streams streamed.
    resumable: bool = False
    broken: BaseException | None = None
    carried: int = 0
    billed_prompt: int | None = None
    ttft_s: float | None = None  # a resumed stream's: the first stream's first token
    _finished: bool = False

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def answer_request_id(self) -> str:
        """The X-Request-ID the client gets (the caller's own, else the console's, sent to the backend)."""
        return self.ctx.answer_request_id if self.ctx is not None else self.request_id

    @property
    def finished(self) -> bool:
        """Released and counted (or handed on to a resumed stream)."""
        return self._finished

    @property
    def is_sse(self) -> bool:
        return self.response.content_type == "text/event-stream"

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers for the client: those FORWARD_RESPONSE_HEADERS lets through, the request id added."""
        keep = FORWARD_RESPONSE_HEADERS
        out = [(k, v) for k, v in self.response.headers if k in keep]
        out.append((b"x-request-id", self.answer_request_id.encode()))
        if self.ctx is not None:
            out.extend(self.ctx.rate_headers)
            out.extend(self.ctx.extra_headers)
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
        except http1.UpstreamTimeout as exc:
            self.finish(error="upstream_timeout")
            raise ProxyError(504, str(exc), code="upstream_timeout") from None
        except (http1.UpstreamError, OSError) as exc:
            self.finish(error="upstream_broken")
            raise ProxyError(502, f"The backend broke off its answer: {exc}", code="upstream_error") from None
        except BaseException:
            self.finish(cancelled=True)
            raise
        self._read_usage(body)
        self.finish()
        return body

    def _read_usage(self, body: bytes) -> None:
        if self.status < 400 and self.response.content_type.endswith("json"):
            self.prompt_tokens, self.completion_tokens = usage_reader.read_body(body)

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body as the backend sends it; an SSE stream that breaks ends with an error event.

        An SSE stream goes out in whole events: bytes after the last event boundary wait for the
        rest of their event, so a stream cut mid-event never glues its error event to half an event.
        A waiting event may grow to PROXY_MAX_SSE_EVENT_BYTES; past that the stream ends with an
        error event (a backend must not make the proxy hold, or rescan, an event without limit).
        Each event passes the usage reader; a stream whose client asked for usage the engine did
        not send gets the usage chunk before its `data: [DONE]`, counted by the console.
        """
        sse = self.is_sse
        reader = self.reader = usage_reader.StreamReader(usage_reader.shape_of(self.upstream_path)) if sse else None
        ctx = self.ctx
        add_usage = (reader is not None and reader.shape in ("chat", "completions") and ctx is not None
                     and ctx.usage_asked and not ctx.drop_usage_chunk)
        add_start = reader is not None and reader.shape == "messages" and self.status < 400
        kept: list[bytes] | None = [] if not sse and self.status < 400 else None  # a JSON body, for its usage
        kept_size = 0
        clean = False
        pending: list[bytes] = []  # bytes after the last event boundary, in arrival order
        pending_size = 0
        limit = settings.PROXY_MAX_SSE_EVENT_BYTES
        strip = sse and ctx is not None and ctx.drop_usage_chunk
        response = self.response
        try:
            async for chunk in response.iter_any():
                if self.first_chunk_s is None:
                    self.first_chunk_s = time.perf_counter() - self.started
                if reader is not None:
                    # Only the new bytes are scanned (plus 3 before them, for a boundary that spans).
                    edge = pending[-1][-3:] if pending else b""
                    end = _event_end(edge + chunk) - len(edge)
                    if end <= 0:
                        pending.append(chunk)
                        pending_size += len(chunk)
                        if pending_size > limit:
                            yield self._too_large(limit)
                            return
                        continue
                    out = b"".join([*pending, chunk[:end]])
                    rest = chunk[end:]
                    pending, pending_size = ([rest], len(rest)) if rest else ([], 0)
                    chunk = out
                    reader.feed(chunk)
                    if add_start:
                        add_start = False
                        if not reader.started:
                            chunk = await self._with_message_start(chunk, reader)
                    if add_usage and reader.done:
                        add_usage = False
                        chunk = await self._with_usage_chunk(chunk)
                    if strip and b'"usage"' in chunk:
                        chunk = strip_usage_events(chunk)
                        if not chunk:
                            continue
                elif kept is not None:
                    kept.append(chunk)
                    kept_size += len(chunk)
                    if kept_size > BODY_USAGE_MAX:  # usage is near the end: the last MiB is kept
                        kept[:] = [b"".join(kept)[-(1 << 20):]]
                        kept_size = len(kept[0])
                # The backend's answer ended in the read that brought these bytes: they are the
                # last (the relay sends them with the response's end, one write instead of two).
                self.last_chunk = not pending and response.at_eof()
                yield chunk
            clean = True
            if pending and reader is not None:  # only an event stream keeps bytes pending
                last = b"".join(pending)  # a last event without its blank line: the backend's own framing
                reader.feed(last)
                if add_usage and reader.done:
                    last = await self._with_usage_chunk(last)
                if strip and b'"usage"' in last:
                    last = strip_usage_events(last)
                if last:
                    yield last
        except (http1.UpstreamError, OSError) as exc:
            if reader is not None and reader.done:
                clean = True  # cut after its last event: the answer is whole, the lost framing is not news
                return
            log.warning("backend %s broke off request %s: %s", self.backend.base_url, self.request_id, exc)
            timeout = isinstance(exc, http1.UpstreamTimeout)
            if self.resumable and sse and not timeout:
                self.broken = exc  # the relay goes on elsewhere, or ends it and counts it
                return
            self.finish(error="upstream_timeout" if timeout else "upstream_broken")
            if sse and timeout:
                yield _error_event(str(exc), status=504, code="upstream_timeout")
            elif sse:
                yield broken_event(exc)
        finally:
            if clean and kept is not None:
                self._read_usage(kept[0] if len(kept) == 1 else b"".join(kept))
            if self.broken is None:
                self.finish(cancelled=not clean)

    async def _with_usage_chunk(self, data: bytes) -> bytes:
        """`data` (the stream's last events) with a usage chunk before its `data: [DONE]` when the
        engine sent none: the prompt as the engine counts it, the completion as the events streamed
        (the figures this request is billed, usage_source `console`)."""
        reader = self.reader
        at = usage_reader.done_at(data)
        if reader is None or reader.prompt is not None or at < 0:
            return data
        reader.prompt = await count_prompt_tokens(self.backend, self.upstream_path, self.body) or 0
        reader.counted_by_console = True
        completion = reader.completion if reader.completion is not None else reader.streamed
        chunk: dict[str, object] = {"id": reader.first_id or f"cmpl-{self.request_id}",
                 "object": "chat.completion.chunk" if reader.shape == "chat" else "text_completion",
                 "created": int(time.time()), "model": self.backend.model_name, "choices": [],
                 "usage": {"prompt_tokens": reader.prompt, "completion_tokens": completion,
                           "total_tokens": reader.prompt + completion}}
        return data[:at] + b"data: " + json.dumps(chunk).encode() + b"\n\n" + data[at:]

    async def _with_message_start(self, data: bytes, reader: usage_reader.StreamReader) -> bytes:
        """`data` (a Messages stream's first events) after the message_start the engine left out
        (llama-server 0.3.36 does when its first token is part of a character: 3 streams in 25 here),
        with the input the engine counts: Anthropic's clients need it first, and it is what is billed."""
        reader.prompt = await count_prompt_tokens(self.backend, self.upstream_path, self.body) or 0
        reader.counted_by_console = reader.started = True
        start = {"type": "message_start", "message": {
            "id": f"msg_{self.request_id}", "type": "message", "role": "assistant", "content": [],
            "model": self.backend.model_name, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": reader.prompt, "output_tokens": 0}}}
        return b"event: message_start\ndata: " + json.dumps(start).encode() + b"\n\n" + data

    def _too_large(self, limit: int) -> bytes:
        log.warning("backend %s sent an SSE event over %d bytes (request %s): stream ended",
                    self.backend.base_url, limit, self.request_id)
        self.finish(error="event_too_large")
        return _error_event(f"The backend sent an SSE event larger than {limit} bytes; the stream was ended.")

    def finish(self, *, error: str | None = None, cancelled: bool = False, record: bool = True) -> None:
        """Release the connection (closed unless fully read), count the request; idempotent.

        A stream whose last event passed is whole: a 200 billed in full, whatever the client did
        after. Otherwise a client that left (499) is billed the prompt the engine processed and the
        tokens streamed so far. Where the engine did not say how many prompt tokens it processed,
        it is asked to count them and the request is recorded once it has (off the answer's path).
        `record` False: a stream that goes on on another replica, counted there (the metrics only)."""
        if self._finished:
            return
        self._finished = True
        self.backend.in_flight -= 1
        if error is None and not cancelled:
            self.response.release()
        else:
            self.response.close()
        reader = self.reader
        if cancelled and reader is not None and reader.done:
            cancelled = False
        status = metrics.CLIENT_GONE if cancelled else self.status
        ended = time.perf_counter()
        busy = recorder.busy_stop(self.backend.instance_id, self.busy_mark) if self.ctx is not None else 0.0
        if reader is not None:
            prompt, completion, streamed = reader.prompt, reader.completion, reader.streamed
            console = reader.counted_by_console
        else:
            prompt, completion, streamed, console = self.prompt_tokens, self.completion_tokens, 0, False
        if self.status >= 400:
            prompt, completion = 0, 0
        if completion is None:
            completion, console = streamed, console or reader is not None
        first = self.first_chunk_s if self.is_sse and self.first_chunk_s is not None else self.first_byte_s
        if not record:
            metrics.record(model=self.backend.model_name, instance_id=self.backend.instance_id, status=status,
                           duration_s=ended - self.started, first_byte_s=self.first_byte_s, error=error)
            return
        if self.carried or self.billed_prompt is not None:  # a resumed stream: every part's tokens, one prompt
            completion += self.carried
            console = True
            if self.billed_prompt is not None:
                prompt = self.billed_prompt
        if prompt is None:
            if error is None and usage_reader.shape_of(self.upstream_path) in usage_reader.GENERATION_SHAPES:
                _later(self._count_then_record(status, error, completion, busy, ended, first))
                return
            prompt = 0
        self._record(status, error, prompt, completion, "console" if console else "engine", busy, ended, first)

    async def _count_then_record(self, status: int, error: str | None, completion: int, busy: float,
                                 ended: float, first: float) -> None:
        prompt = None
        try:
            prompt = await count_prompt_tokens(self.backend, self.upstream_path, self.body)
        finally:  # cancelled too (a shutdown that could wait no longer): the request is logged all the same
            self._record(status, error, prompt or 0, completion, "console", busy, ended, first)

    def _record(self, status: int, error: str | None, prompt: int, completion: int, source: str, busy: float,
                ended: float, first: float) -> None:
        metrics.record(
            model=self.backend.model_name, instance_id=self.backend.instance_id, status=status,
            duration_s=ended - self.started, first_byte_s=self.first_byte_s,
            prompt_tokens=prompt, completion_tokens=completion, error=error,
        )
        ctx = self.ctx
        if ctx is not None:
            recorder.record(ctx, model=usage_model(ctx, self.backend), instance_id=self.backend.instance_id,
                            node=self.backend.node, status=status, error=error, prompt_tokens=prompt,
                            completion_tokens=completion, busy_s=busy,
                            ttft_s=self.ttft_s if self.ttft_s is not None else (self.started - ctx.t0) + first,
                            failed=error is not None or (status >= 400 and status != metrics.CLIENT_GONE),
                            ended=ended, usage_source=source)
            if ctx.principal is not None and (prompt or completion):
                limiter().charge(ctx.principal, prompt + completion)

    def abort(self) -> None:
        """Close the upstream connection now (the client went away)."""
        self.finish(cancelled=True)


# ---------------------------------------------------------------- what the engine counts
_counting: set[asyncio.Task] = set()


def _later(work) -> None:
    """Run `work` (a coroutine recording a request once the engine has counted it) off the answer's path."""
    task = asyncio.get_running_loop().create_task(work)
    _counting.add(task)
    task.add_done_callback(_counted)


def _counted(task: asyncio.Task) -> None:
    _counting.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("recording a request after its prompt count failed", exc_info=task.exception())


async def drain_counts(timeout_s: float = 10.0) -> None:
    """Wait for the prompt counts still running, so the requests they belong to are recorded;
    those the engine has not answered by `timeout_s` are recorded without its count."""
    if not _counting:
        return
    _, late = await asyncio.wait(set(_counting), timeout=timeout_s)
    if late:
        log.warning("%d prompt count(s) unanswered after %g s at shutdown: their requests are logged with "
                    "prompt 0", len(late), timeout_s)
        for task in late:
            task.cancel()
        await asyncio.wait(late)


async def count_prompt_tokens(backend: Backend, upstream_path: str, body: bytes) -> int | None:
    """The prompt tokens the engine behind `backend` processes for `body` on `upstream_path`, as
    the engine counts them (usage_reader.count_request says how); None when it cannot say."""
    plan = usage_reader.count_request(backend.backend, upstream_path, body)
    if plan is None:
        return None
    path, request = plan
    response: http1.Response | None = None
    backend.in_flight += 1
    headers = b"content-type: application/json\r\n" + backend.auth_header
    try:
        async with asyncio.timeout(COUNT_TIMEOUT_S):
            try:
                response = await client().post(backend.base_url, path, request, headers)
            except http1.Disconnected:  # a pooled connection the backend had closed: once more, on a new one
                response = await client().post(backend.base_url, path, request, headers)
            data = await response.read()
    except (http1.UpstreamError, OSError, TimeoutError) as exc:
        log.warning("backend %s did not count a prompt (%s %s): %s", backend.base_url, path, upstream_path, exc)
        return None
    finally:
        backend.in_flight -= 1
        if response is not None:
            response.release()
    if response.status != 200:
        log.warning("backend %s answered %d to counting a prompt (%s)", backend.base_url, response.status, path)
        return None
    return usage_reader.counted(data)


def record_abandoned(ctx: RequestContext, candidates: list[Backend], upstream_path: str, body: bytes, *,
                     sent: bool) -> None:
    """A request whose client left before a backend answered a byte: in the request log as 499,
    charged the prompt the engine processed when it had been sent (counted by the engine)."""
    backend = candidates[0]  # any replica counts a prompt alike
    ended = time.perf_counter()

    def record(prompt: int) -> None:
        metrics.record(model=backend.model_name, instance_id=backend.instance_id, status=metrics.CLIENT_GONE,
                       duration_s=ended - ctx.t0, first_byte_s=None, prompt_tokens=prompt, completion_tokens=0)
        recorder.record(ctx, model=usage_model(ctx, backend), instance_id=backend.instance_id, node=backend.node,
                        status=metrics.CLIENT_GONE, error=None, prompt_tokens=prompt, completion_tokens=0,
                        busy_s=0.0, ttft_s=None, failed=False, ended=ended, usage_source="console")
        if ctx.principal is not None and prompt:
            limiter().charge(ctx.principal, prompt)

    if not sent or usage_reader.shape_of(upstream_path) not in usage_reader.GENERATION_SHAPES:
        record(0)
        return

    async def count_then_record() -> None:
        prompt = None
        try:
            prompt = await count_prompt_tokens(backend, upstream_path, body)
        finally:  # cancelled too (a shutdown that could wait no longer): the request is logged all the same
            record(prompt or 0)

    _later(count_then_record())


def strip_usage_events(data: bytes) -> bytes:
    """`data` (whole SSE events) without the usage-only chunk (`"choices": []` and a usage) that the
    proxy asked the backend for on behalf of a client that did not ask for it.

    Only the events that hold `"usage"` are cut out and read; the bytes around them are kept as
    they are (splitting the whole chunk at every boundary with a look-behind pattern tried each byte:
    the usage-bearing last chunk of an unpaced stream, ~100 events, took ~0.4 ms)."""
    kept = []
    start = 0  # the bytes before it are decided (always an event boundary)
    at = data.find(usage_reader.USAGE_KEY)
    while at >= 0:
        begin = usage_reader.last_boundary(data, at, start)
        lf, crlf = data.find(b"\n\n", at), data.find(b"\r\n\r\n", at)
        end = min(lf + 2 if lf >= 0 else len(data), crlf + 4 if crlf >= 0 else len(data))
        if _usage_only(data[begin:end]):
            kept.append(data[start:begin])
            start = end
        at = data.find(usage_reader.USAGE_KEY, end)
    if not kept:
        return data
    kept.append(data[start:])
    return b"".join(kept)


def _usage_only(event: bytes) -> bool:
    """Whether one SSE event is a usage-only chunk (a usage and no choices)."""
    event = event.lstrip()
    if not event.startswith(b"data:"):
        return False
    try:
        payload = json.loads(event[5:])
    except ValueError:
        return False
    return isinstance(payload, dict) and bool(payload.get("usage")) and not payload.get("choices")


def _error_event(message: str, *, status: int = 502, code: str = "upstream_error") -> bytes:
    return b"data: " + json.dumps(error_body(message, status=status, code=code)).encode() + b"\n\n"


def broken_event(exc: BaseException) -> bytes:
    """The error event that ends a stream its backend broke off."""
    return _error_event(f"The backend stopped before finishing this answer ({exc.__class__.__name__}).")


def _event_end(data: bytes) -> int:
    """Where the last complete SSE event in `data` ends (0 when none does)."""
    return usage_reader.last_boundary(data, len(data))


def forward_headers(raw: list[tuple[bytes, bytes]], request_id: str, form: bytes | None = None) -> bytes:
    """The caller's headers that FORWARD_REQUEST_HEADERS lets through (none that its Connection
    header names), the content type the body was parsed by (forwarded_content_type of `form`, the
    multipart form's Content-Type parameters that request_payload read; None for JSON: the
    caller's Content-Type is not read again) and the console's own X-Request-ID, as `name: value`
    lines ready for the request."""
    keep = FORWARD_REQUEST_HEADERS
    lines = []
    hop: set[bytes] = set()
    for name, value in raw:
        name = name.lower()
        if name == b"connection":  # headers it lists are hop-by-hop, even ones kept otherwise
            hop.update(token.strip().lower() for token in value.split(b","))
        elif name in keep and b"\r" not in value and b"\n" not in value:
            lines.append((name, value))
    out = [b"%s: %s\r\n" % (name, value) for name, value in lines if name not in hop]
    out.append(b"content-type: %s\r\n" % forwarded_content_type(form))
    out.append(b"x-request-id: %s\r\n" % request_id.encode("latin-1"))
    return b"".join(out)


def forwarded_content_type(form: bytes | None) -> bytes:
    """The content type a body goes to a backend with: the proxy parsed it as JSON unless it is a
    multipart form (serving.proxy.bodies.request_payload refuses every other type and returns a
    form's Content-Type parameters as `form`), so JSON is sent as `application/json` (also what
    `curl -d` labels x-www-form-urlencoded) and a form as `multipart/form-data` with only its
    boundary kept."""
    if form is None:
        return b"application/json"
    boundary = multipart_boundary(form) or b""
    if not TOKEN_RE.fullmatch(boundary):
        boundary = b'"' + boundary + b'"'
    return b"multipart/form-data; boundary=" + boundary


MULTIPART_BOUNDARY_RE = re.compile(rb"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")  # RFC 2046
TOKEN_RE = re.compile(rb"[0-9A-Za-z!#$%&'*+\-.^_`|~]+")  # RFC 9110: a parameter value that needs no quotes


def multipart_boundary(params: bytes) -> bytes | None:
    """The boundary in a multipart Content-Type's parameters (1-70 characters of RFC 2046's set,
    quoted or not); None when there is none or it is not a valid one."""
    for param in params.split(b";"):
        name, _, raw = param.partition(b"=")
        if name.strip().lower() == b"boundary":
            raw = raw.strip()
            if len(raw) >= 2 and raw[:1] == raw[-1:] == b'"':
                raw = raw[1:-1]
            return raw if MULTIPART_BOUNDARY_RE.fullmatch(raw) else None
    return None


async def open_upstream(*, path: str, query: bytes, body: bytes, candidates: list[Backend],
                        headers: list[tuple[bytes, bytes]], request_id: str,
                        upstream_path: str | None = None, ctx: RequestContext | None = None,
                        form: bytes | None = None) -> UpstreamReply:
    """Send the request to the least busy replica (the next one if it refuses); return at headers.

    The backend's path is `upstream_path`, or by default the part of `path` from `/v1/` on. With
    `ctx`, the exchange is counted in the usage buckets and the request log when it finishes.
    `form`: the body is a multipart form with these Content-Type parameters (None: JSON)."""
    if upstream_path is None:
        upstream_path = path[path.index("/v1/"):]
    target = upstream_path + "?" + query.decode("latin-1") if query else upstream_path
    fwd = forward_headers(headers, request_id, form)
    session = client()
    last_exc: Exception | None = None
    attempts = routing_table.order(candidates, ctx.route_key if ctx is not None else None)
    retried: set[int] = set()
    while attempts:
        backend = attempts.pop(0)
        backend.in_flight += 1
        busy_mark = recorder.busy_start(backend.instance_id) if ctx is not None else 0.0
        started = time.perf_counter()
        try:
            response = await session.post(backend.base_url, target, body, fwd + backend.auth_header,
                                          first_byte_timeout_s=backend.first_byte_timeout_s)
        except BaseException as exc:
            backend.in_flight -= 1
            if ctx is not None:
                recorder.busy_stop(backend.instance_id, busy_mark)
            if isinstance(exc, http1.ConnectFailed):
                # No connection, nothing sent: this replica is gone (or unreachable), try the next.
                backend.mark_down()
                last_exc = exc
                metrics.record(model=backend.model_name, instance_id=backend.instance_id, status=502,
                               duration_s=time.perf_counter() - started, first_byte_s=None, error="connect")
                continue
            if isinstance(exc, http1.Disconnected) and not exc.retry_safe:
                # Closed after the request reached it: it may have run (a POST is never sent twice).
                _failed_on(ctx, backend, exc)
                metrics.record(model=backend.model_name, instance_id=backend.instance_id, status=502,
                               duration_s=time.perf_counter() - started, first_byte_s=None, error="upstream")
                raise ProxyError(502, f"The backend closed the connection after it received the request, "
                                      f"without answering; it is not sent again ({exc})", code="upstream_error") from None
            if isinstance(exc, http1.Disconnected):
                # Closed before the request reached it (its kernel acknowledged none of it); most often a
                # pooled connection to a backend that restarted: one more try on a fresh connection tells
                # a restart from a dead replica.
                last_exc = exc
                if id(backend) not in retried:
                    retried.add(id(backend))
                    attempts.insert(0, backend)
                else:
                    backend.mark_down()
                    metrics.record(model=backend.model_name, instance_id=backend.instance_id, status=502,
                                   duration_s=time.perf_counter() - started, first_byte_s=None, error="connect")
                continue
            if isinstance(exc, http1.FirstByteTimeout):
                _failed_on(ctx, backend, exc)
                metrics.record(model=backend.model_name, instance_id=backend.instance_id, status=504,
                               duration_s=time.perf_counter() - started, first_byte_s=None, error="timeout")
                raise ProxyError(504, str(exc), code="upstream_timeout") from None
            if isinstance(exc, http1.UpstreamError | OSError):
                _failed_on(ctx, backend, exc)
                metrics.record(model=backend.model_name, instance_id=backend.instance_id, status=502,
                               duration_s=time.perf_counter() - started, first_byte_s=None, error="upstream")
                raise ProxyError(502, f"The backend failed before answering: {exc.__class__.__name__}: {exc}",
                                 code="upstream_error") from None
            raise
        backend.down_until = 0.0
        return UpstreamReply(backend=backend, response=response, started=started,
                             first_byte_s=time.perf_counter() - started, request_id=request_id,
                             ctx=ctx, busy_mark=busy_mark)
    names = ", ".join(sorted({b.model_name for b in candidates}))
    raise ProxyError(502, f"No backend for {names} accepted the connection ({last_exc}).",
                     code="upstream_unreachable")




def _failed_on(ctx: RequestContext | None, backend: Backend, exc: BaseException) -> None:
    """A replica failed a request it was sent: its row in the request log names it, and one log line
    says which connection (the evidence for a failure nobody can reproduce at will)."""
    if ctx is not None:
        ctx.failed_on = (backend.instance_id, backend.node)
    log.warning("request %s failed on %s (instance %s of %s, node %s): %s: %s",
                ctx.request_id if ctx is not None else "-", backend.base_url, backend.instance_id,
                backend.model_name, backend.node, exc.__class__.__name__, exc)


class UpstreamPoolCollector:
    """Leak indicators for soak tests and dashboards, read at scrape time: event-loop tasks, and
    the pooled client's connections to backends (idle in the pool / in use)."""

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:  # scraped outside the event loop
            tasks = 0
        yield GaugeMetricFamily("xgen_event_loop_tasks", "asyncio tasks alive in this process's loop", value=tasks)
        conns = GaugeMetricFamily("xgen_proxy_upstream_connections", "Connections to backends", labels=["state"])
        idle, in_use = _client.stats() if _client is not None else (0, 0)
        conns.add_metric(["idle"], idle)
        conns.add_metric(["in_use"], in_use)
        yield conns

    def describe(self):
        return []


metrics.REGISTRY.register(UpstreamPoolCollector())
