"""Admission: before a request is forwarded, the key's allowed models and limits (rpm, tpm, token
quotas through serving.proxy.limits; a team's GPU-seconds budget through serving.proxy.gpu_budget),
usage asked of a stream, and the wait for a cold start of an IDLE model (keep-alive comments for a
stream)."""
from __future__ import annotations

import asyncio
import json
import time

from django.conf import settings

from accounts.credentials import Principal
from accounts.errors import ErrorAnswer
from serving.proxy import metrics, ondemand
from serving.proxy.errors import ProxyError
from serving.proxy.gpu_budget import budgets as gpu_budgets
from serving.proxy.limits import limiter
from serving.proxy.relay import ClientWatch, request_task
from serving.proxy.replicas import Backend
from serving.proxy.routing import ColdStartNeeded, Route, not_allowed
from serving.proxy.usage import RequestContext, recorder


async def admit_request(ctx: RequestContext, payload: dict, body: bytes, *, operation: str) -> bytes:
    """Before forwarding: the key's and its team's allowed models, the team's GPU-seconds budget
    (serving.proxy.gpu_budget) and limits (ProxyError 403 / 429; the team's from the same cached
    principal, no database per request), and, for a
    stream, usage asked of the backend when the client did not ask (the proxy counts tokens from
    it and drops that chunk before the client sees it). Returns the body to forward. The allowed
    models are checked here only (the body names the served name by now: resolve_alias ran), before
    the limits, so a refused model costs no request of the key's rpm."""
    p = ctx.principal
    model = payload.get("model")
    ctx.model = model[:255] if isinstance(model, str) else ""
    ctx.stream = payload.get("stream") is True
    if p is not None:
        if isinstance(model, str) and model and not p.may_use(model):
            raise not_allowed(model, p)
        team = p.team
        if team is not None and team.gpu_seconds_month:  # before the limits: a refusal costs no request
            await gpu_budgets.check(team)
        if team is not None and team.limited:  # the team's limits, all its keys together, then the key's
            verdict = await limiter().admit(team)
            if not verdict.allowed:
                raise ProxyError(429, verdict.message(team), code=verdict.code, headers=verdict.headers)
            ctx.rate_headers = verdict.headers
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
    if principal is None:
        return []
    if not (principal.rpm or principal.tpm):
        team = principal.team
        if team is None or not (team.rpm or team.tpm):
            return []
        principal = team
    return (await limiter().admit(principal, cost=0)).headers


async def cold_candidates(need: ColdStartNeeded, send, route: Route, ctx: RequestContext, watch: ClientWatch
                          ) -> list[Backend] | None:
    """Start an IDLE model (every replica IDLE or on its way up) and wait for it with the client
    watched (None: it left, or its stream was answered with the failure); X-XGEN-Cold-Start is set.
    A model of another type than the path needs is refused before anything starts. A stream gets
    `: loading N%` comments while it waits."""
    kind = route.kind
    if kind is not None and need.standby[0].type != kind:
        raise ProxyError(400, f"The model '{need.model}' is a {need.standby[0].type} model; this path needs "
                              f"a{'n' if kind[0] in 'aeiou' else ''} {kind} model.", code="model_type_mismatch")
    current = request_task()
    sse = False

    async def keepalive(start: ondemand.ColdStart, task: asyncio.Task) -> list[Backend]:
        nonlocal sse
        every = settings.COLD_START_KEEPALIVE_S
        done, _ = await asyncio.wait({task}, timeout=every)
        while not done:
            if not sse:
                sse = ctx.comments_sent = True
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                    (b"x-request-id", ctx.answer_request_id.encode()),
                    (b"x-xgen-cold-start", f"{time.perf_counter() - start.began:.2f}".encode())]})
            await send({"type": "http.response.body", "body": f": loading {start.pct}%\n\n".encode(),
                        "more_body": True})
            done, _ = await asyncio.wait({task}, timeout=max(every, 0.5))
        return task.result()

    watch.watch()
    try:
        began = time.perf_counter()
        start, task = await ondemand.cold_start(need.model, need.standby)
        group = await (keepalive(start, task) if ctx.stream else asyncio.shield(task))
        ctx.extra_headers.append((b"x-xgen-cold-start", f"{time.perf_counter() - began:.2f}".encode()))
        return group
    except asyncio.CancelledError:
        if not watch.gone:
            raise
        current.uncancel()  # the client left: the start goes on for the next request, nothing else stays
        recorder.record_refused(ctx, status=metrics.CLIENT_GONE, code="client_gone")  # no backend saw it
        return None
    except ErrorAnswer as exc:
        if not sse:
            raise
        metrics.record_rejected(exc.code or str(exc.status))
        recorder.record_refused(ctx, status=exc.status, code=exc.code)
        await send({"type": "http.response.body", "body": b"data: " + exc.body() + b"\n\n", "more_body": False})
        return None


class AfterComments:
    """`send` for an answer whose SSE headers went out with the loading comments: the backend's
    own response start is not sent again."""

    def __init__(self, send) -> None:
        self.send = send

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            return
        await self.send(message)
