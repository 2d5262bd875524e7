"""The client's failures as the proxy answers them (issue 23): the waits after the connect (504
`upstream_timeout` before any byte, an SSE error event with that code mid-stream, the
connection closed and the request counted), a POST never sent twice, and an error page over
64 KiB counted as the backend's status, not as a client that left. In process: the proxy's own
ASGI app (serving.web.inference_api.run_proxy) in front of a scripted loopback backend."""
from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import REGISTRY

from serving.proxy import http1
from tests.proxy.test_http1 import JSON_OK, Backend

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.fixture
def proxy(transactional_db, viewer, settings, monkeypatch):
    """`add(name, backend, **row)` makes a READY instance for a scripted backend; `ask(name, stream)`
    sends a chat request through the proxy: (status, headers, body)."""
    from asgiref.sync import sync_to_async
    from django.utils import timezone

    from hardware.models import Node
    from serving.models import ModelInstance
    from serving.proxy.replicas import routing_table
    from serving.web.inference_api import run_proxy

    settings.QUEUE_MAX = 0
    settings.PROXY_IDLE_TIMEOUT_S = 1
    monkeypatch.setattr(http1, "TICK_S", 0.05)
    node = Node.objects.create(name="gpu-http1", address="127.0.0.1", last_heartbeat=timezone.now())

    class Proxy:
        @staticmethod
        async def add(name: str, backend: Backend, **row) -> int:
            inst = await sync_to_async(ModelInstance.objects.create)(
                model_name=name, model_path="/m", backend="llama-server", node=node, port=backend.port,
                state="READY", ready_at=timezone.now(), **row)
            routing_table.invalidate()
            return inst.pk

        @staticmethod
        async def ask(name: str, *, stream: bool = False) -> tuple[int, dict, bytes]:
            scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
                     "headers": [(b"authorization", f"Bearer {viewer.key}".encode()),
                                 (b"content-type", b"application/json")], "client": ("127.0.0.1", 1)}
            body = json.dumps({"model": name, **CHAT, "stream": stream}).encode()
            start, chunks = await run_proxy(scope, body)
            data = b"".join([chunk async for chunk in chunks])
            return start["status"], dict(start["headers"]), data

    yield Proxy


def chats(requests: list[bytes]) -> list[bytes]:
    """The chat requests a backend read (not the proxy's own prompt counts that may follow)."""
    return [r for r in requests if r.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")]


def requests_counted(model: str, status: int) -> float:
    samples = [s for metric in REGISTRY.collect() if metric.name == "xgen_inference_requests" for s in metric.samples
               if s.name.endswith("_total") and s.labels["model"] == model and s.labels["status"] == str(status)]
    return sum(s.value for s in samples)


def errors_counted(model: str, reason: str) -> float:
    samples = [s for metric in REGISTRY.collect() if metric.name == "xgen_inference_errors" for s in metric.samples
               if s.name.endswith("_total") and s.labels["model"] == model and s.labels["reason"] == reason]
    return sum(s.value for s in samples)


async def test_a_backend_silent_past_the_models_first_byte_timeout_is_504(proxy):
    from serving.proxy.upstream import shutdown_proxy

    async def answer(request, writer):
        await asyncio.sleep(10)

    try:
        async with Backend(answer) as backend:
            await proxy.add("slow-prefill", backend, first_byte_timeout_s=1)  # the model's own wait
            status, _, body = await asyncio.wait_for(proxy.ask("slow-prefill"), 8)
            assert status == 504, body
            error = json.loads(body)["error"]
            assert error["code"] == "upstream_timeout" and "1 s" in error["message"], error
            assert set(error) == {"message", "type", "code"}
            assert errors_counted("slow-prefill", "timeout") == 1
            assert len(chats(backend.requests)) == 1  # not sent again
    finally:
        await shutdown_proxy()


async def test_a_stream_that_stalls_midway_ends_with_an_upstream_timeout_event(proxy):
    from serving.proxy.upstream import shutdown_proxy

    event = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'

    async def answer(request, writer):
        writer.write(SSE_HEAD + b"%x\r\n%s\r\n" % (len(event), event) * 2)
        await writer.drain()
        await asyncio.sleep(10)  # then nothing: past the idle timeout (1 s here)

    try:
        async with Backend(answer) as backend:
            await proxy.add("stalls", backend)
            status, headers, body = await asyncio.wait_for(proxy.ask("stalls", stream=True), 8)
            assert status == 200 and headers[b"content-type"] == b"text/event-stream"
            events = [e for e in body.split(b"\n\n") if e]
            assert events[:2] == [event.strip()] * 2
            error = json.loads(events[-1].removeprefix(b"data: "))["error"]
            assert error["code"] == "upstream_timeout" and "idle" in error["message"], error
            # Counted: the request, its error, the two text events as its completion tokens.
            assert errors_counted("stalls", "upstream_timeout") == 1
            assert requests_counted("stalls", 200) == 1
            from serving.proxy import metrics
            usage = [u for (model, _), u in metrics._usage.items() if model == "stalls"]
            assert usage[0].completion_tokens == 2 and usage[0].errors == 1
    finally:
        await shutdown_proxy()


async def test_a_backend_that_closes_after_reading_a_post_is_not_sent_it_again(proxy):
    """Before: open_upstream retried every `Disconnected` once, so a backend that read the
    request, started it and closed got it twice."""
    from serving.proxy.upstream import shutdown_proxy

    async def answer(request, writer):
        return "close"

    from asgiref.sync import sync_to_async

    from serving.models import RequestLog
    from serving.proxy.usage import recorder

    try:
        async with Backend(answer) as backend:
            pk = await proxy.add("closes", backend)
            status, _, body = await proxy.ask("closes")
            assert status == 502 and json.loads(body)["error"]["code"] == "upstream_error", body
            message = json.loads(body)["error"]["message"]
            assert "not sent again" in message and "request 1 on a connection opened" in message, message
            assert len(chats(backend.requests)) == 1
            # The request log names the replica that failed it (it said no instance before).
            await recorder.flush()
            rows = await sync_to_async(lambda: list(RequestLog.objects.filter(model="closes").values_list(
                "status", "error", "instance_id", "node")))()
            assert rows == [(502, "upstream_error", pk, "gpu-http1")], rows
    finally:
        await shutdown_proxy()


async def test_a_pooled_connection_closed_before_the_request_is_retried_once(proxy):
    """The one retry that stays: the backend closed before the request reached it."""
    import time

    from serving.proxy.upstream import shutdown_proxy
    from tests.proxy.test_http1 import _closing_backend

    listener, url, close_all, requests = _closing_backend()
    port = int(url.rsplit(":", 1)[1])

    class At:
        pass

    at = At()
    at.port = port
    try:
        await proxy.add("restarts", at)
        assert (await proxy.ask("restarts"))[0] == 200
        close_all()
        time.sleep(0.2)  # the close happens while the loop is busy: the pooled connection looks alive
        status, _, body = await proxy.ask("restarts")
        assert status == 200 and body == b'{"ok":true}'
        assert len(chats(requests)) == 2  # each request read once
    finally:
        listener.close()
        await shutdown_proxy()


async def test_an_error_page_over_64_kib_counts_as_the_backends_status(proxy):
    """Before: the relay stopped reading a long error page after 64 KiB and the exchange was
    counted as CLIENT_GONE (499), not as the backend's 500."""
    from serving.proxy.upstream import shutdown_proxy

    page = b"<html>" + b"x" * (100 * 1024) + b"</html>"

    async def answer(request, writer):
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/html\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(page), page))
        await writer.drain()

    try:
        async with Backend(answer) as backend:
            await proxy.add("long-error", backend)
            status, _, body = await proxy.ask("long-error")
            assert status == 500 and json.loads(body)["error"]["code"] == "upstream_error"
            assert requests_counted("long-error", 500) == 1
            assert requests_counted("long-error", 499) == 0
    finally:
        await shutdown_proxy()


async def test_a_normal_answer_still_passes(proxy):
    from serving.proxy.upstream import shutdown_proxy

    try:
        async with Backend(lambda request, writer: _write(writer, JSON_OK)) as backend:
            await proxy.add("fine", backend, first_byte_timeout_s=900)
            assert (await proxy.ask("fine"))[:1] == (200,)
    finally:
        await shutdown_proxy()


async def _write(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    await writer.drain()


async def test_an_oversized_head_is_a_clean_502(proxy):
    from serving.proxy.upstream import shutdown_proxy

    head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(500)) + b"Content-Length: 2\r\n\r\n{}"
    try:
        async with Backend(lambda request, writer: _write(writer, head)) as backend:
            await proxy.add("big-head", backend)
            status, _, body = await proxy.ask("big-head")
            error = json.loads(body)["error"]
            assert status == 502 and error["code"] == "upstream_error" and "head is over" in error["message"], body
    finally:
        await shutdown_proxy()
