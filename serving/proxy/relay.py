"""Relay: open the upstream request on a chosen replica (inside its max_concurrency slot), answer
the client chunk by chunk, watch for the client leaving (which cancels the upstream request), and
time the exchange (Server-Timing, /metrics)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

from django.conf import settings

from accounts.errors import ErrorAnswer, error_body
from serving.proxy import metrics, ondemand
from serving.proxy import resume as resuming
from serving.proxy.replicas import Backend
from serving.proxy.upstream import (
    UpstreamReply,
    broken_event,
    count_prompt_tokens,
    open_upstream,
    record_abandoned,
)
from serving.proxy.usage import RequestContext

WATCH_AFTER_S = 0.05  # a forwarded exchange still running this long watches for the client leaving


def request_task() -> asyncio.Task:
    """The task that runs this request (the server calls an ASGI app in one)."""
    task = asyncio.current_task()
    assert task is not None
    return task


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



class ClientWatch:
    """The one watch of a request for its client leaving (an `http.disconnect`): it cancels the
    request's task, which the step it is in (a cold-start wait, the relay) ends quietly, seeing
    `gone`. A cold-start wait starts it at once; an exchange only once it outlasts WATCH_AFTER_S:
    most answers are done sooner, and a task a request cost ~7 us of CPU. A stream, or a backend
    slow to answer, is watched from then on (uvicorn and daphne drop what is sent to a client that
    left, so nothing but this watch would stop the upstream request)."""

    def __init__(self, receive) -> None:
        self.receive = receive
        self.gone = False
        self.done = False
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, after_s: float = 0.0) -> None:
        """Watch from now (or from `after_s` on) for the client leaving; a watch running goes on."""
        if self._task is not None or self._timer is not None or self.done:
            return
        target = request_task()
        if after_s > 0:
            self._timer = asyncio.get_running_loop().call_later(after_s, self._start, target)
        else:
            self._start(target)

    def _start(self, target: asyncio.Task) -> None:
        if self._task is None and not self.done:
            self._task = asyncio.create_task(self._run(target))

    async def _run(self, target: asyncio.Task) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                if not self.done:
                    self.gone = True
                    target.cancel()
                return

    def close(self) -> None:
        """The answer is done: a client leaving now changes nothing."""
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


async def forward(scope, watch: ClientWatch, send, *, path: str, body: bytes, candidates: list[Backend],
                  ctx: RequestContext, started: float | None = None, upstream_path: str | None = None,
                  relay=None, shape_error=openai_error_for, form: bytes | None = None,
                  resume: resuming.Resume | None = None) -> None:
    """Open the upstream request inside the model's max_concurrency slot and answer through
    `relay` (by default `passthrough`), with the client watched (`watch`). `form`: the body is a
    multipart form with these Content-Type parameters (request_payload's reading; None: JSON).
    `resume`: a stream that may go on on another replica when its own breaks (serving.proxy.resume)."""
    current = request_task()
    started = time.perf_counter() if started is None else started
    watch.watch(WATCH_AFTER_S)
    reply: UpstreamReply | None = None
    slot = ondemand.NO_SLOT
    sent = False  # the request went to a backend (past the max_concurrency queue)
    sent_path = upstream_path or path
    try:
        # max_concurrency: wait for a slot here, where a client that leaves is noticed.
        slot = await ondemand.admit(candidates[0].model_name, candidates, priority(ctx),
                                    ondemand.queue_owner(ctx.principal, ctx.client))
        sent = True
        reply = await open_upstream(path=path, query=scope.get("query_string", b""), body=body,
                                    candidates=candidates, headers=scope["headers"], request_id=ctx.request_id,
                                    upstream_path=upstream_path, ctx=ctx, form=form)
        reply.upstream_path, reply.body = sent_path, body  # what the usage reader and a prompt count go by
        ondemand.activity.touch(reply.backend)

        def timing(excluded_s: float = 0.0) -> tuple[bytes, bytes]:
            return server_timing(started, reply, excluded_s=excluded_s)

        if relay is None and resume is not None and reply.status == 200 and reply.is_sse:
            async def reopen(again: bytes, tried: set[int]) -> UpstreamReply | None:
                others = [b for b in candidates if b.instance_id not in tried]
                if not others:
                    return None
                return await open_upstream(path=path, query=scope.get("query_string", b""), body=again,
                                           candidates=others, headers=scope["headers"], request_id=ctx.request_id,
                                           upstream_path=upstream_path, ctx=ctx)

            reply = await relay_resuming(reply, send, timing, resume, reopen, body=body, sent_path=sent_path,
                                         ctx=ctx)
        elif relay is None:
            await passthrough(reply, send, timing, shape_error=shape_error)
        else:
            await relay(reply, send, timing)
        watch.close()
    except asyncio.CancelledError:
        if not watch.gone:
            raise
        current.uncancel()  # the client left: not an error, just stop
        if reply is None:  # before a backend's first byte: a 499 in the log, billed what the engine got
            record_abandoned(ctx, candidates, sent_path, body, sent=sent)
    except OSError:
        pass  # the server could not write to a client that went away
    finally:
        watch.close()
        if reply is not None:
            reply.abort()
        slot.release()


async def relay_resuming(reply: UpstreamReply, send, timing, resume: resuming.Resume, reopen, *, body: bytes,
                         sent_path: str, ctx: RequestContext) -> UpstreamReply:
    """`passthrough` for an event stream that may go on on another replica: when the stream breaks
    (reply.broken) and what it carried can be continued, the request goes again to another
    replica with that text as the answer's start (serving.proxy.resume), and its events follow
    as the same stream. Returns the reply relayed last (the caller closes it)."""
    await send({"type": "http.response.start", "status": reply.status, "headers": [*reply.headers(), timing(0.0)]})
    current = reply
    reply.resumable = True
    tried: set[int] = set()
    try:
        while True:
            async with contextlib.aclosing(current.chunks()) as stream:
                async for chunk in stream:
                    if resume.resumes:
                        chunk = resume.rewrite(chunk, billed_prompt=current.billed_prompt)
                        if not chunk:
                            continue
                    resume.keep(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if current.broken is None:
                break
            following = await _resume(current, resume, reopen, tried, body=body, sent_path=sent_path, ctx=ctx)
            if following is None:
                await send({"type": "http.response.body", "more_body": True, "body": broken_event(current.broken)})
                break
            current = following
            await send({"type": "http.response.body", "more_body": True,
                        "body": b": resumed on another replica after the stream broke\n\n"})
    finally:
        for one in (reply, current):  # a client that left: each part not yet counted, as a 499
            if not one.finished:
                one.abort()
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return current


async def _resume(broken: UpstreamReply, resume: resuming.Resume, reopen, tried: set[int], *, body: bytes,
                  sent_path: str, ctx: RequestContext) -> UpstreamReply | None:
    """The stream that goes on where `broken` stopped, on another replica; None (with `broken`
    counted as the failure it is) when it cannot."""
    model = broken.backend.model_name
    tried.add(broken.backend.instance_id)
    broken.backend.mark_down()
    got = resume.text_so_far()
    again = None
    if resume.resumes >= settings.STREAM_RESUME_MAX:
        why = "limit"
    elif got is None:
        why = "not_resumable"
    else:
        again = resume.next_body(body, broken.backend.backend, resume.done_text + got[0], resume.carried + got[1])
        why = "" if again is not None else "not_resumable"
    following: UpstreamReply | None = None
    if again is not None:
        try:
            following = await reopen(again, tried)
        except ErrorAnswer:
            following = None
        if following is None:
            why = "no_replica"
        elif following.status != 200 or not following.is_sse:
            following.finish(error=f"status_{following.status}", record=False)
            following, why = None, "failed"
    if following is None:
        resuming.count(model, why)
        broken.finish(error="upstream_broken")  # its row, as a stream that broke
        return None
    try:  # the original request's prompt, as the engine counts it: what the whole stream bills
        billed = await count_prompt_tokens(following.backend, sent_path, body)
    except BaseException:
        following.abort()  # the client left meanwhile: `broken` is counted as a 499 by the caller
        raise
    text, tokens = got or ("", 0)
    if resume.ttft_s is None and broken.first_chunk_s is not None:
        resume.ttft_s = broken.started - ctx.t0 + broken.first_chunk_s
    resume.begin_resume(text, tokens, following.backend.backend)
    broken.finish(error="upstream_broken", record=False)  # counted with the stream that goes on
    following.resumable = True
    following.upstream_path, following.body = sent_path, body
    following.carried, following.ttft_s, following.billed_prompt = resume.carried, resume.ttft_s, billed
    ctx.resumes = resume.resumes
    resuming.count(model, "resumed")
    return following


def priority(ctx: RequestContext) -> int:
    """The queue priority of the request's key (a browser session is normal)."""
    p = ctx.principal
    return int(p.priority) if p is not None and p.key_id else 4
