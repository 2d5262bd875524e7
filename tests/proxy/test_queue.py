"""The per-model queue (issue 13): max_concurrency 1 and XGEN_QUEUE_MAX=2 on a real console.

The backend is a test server whose streams send one chunk and then wait until the test lets
them finish, so "slow" is decided by the test, never by a clock: the order the requests reach the
backend is the order the queue served them."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import start_console
from tests.procs import stop_process
from tests.proxy.conftest import AiohttpBackend, ProxyConsole

MODEL = "queued"


class GateBackend(AiohttpBackend):
    """Streams `data: {"content": <tag>}` at once, then waits for `release(tag)` before [DONE]
    (a tag starting with `hold` waits before it answers anything)."""

    def __init__(self) -> None:
        self.arrived: list[str] = []
        self._gates: dict[str, asyncio.Event] = {}
        super().__init__()

    def _gate(self, tag: str) -> asyncio.Event:
        if tag not in self._gates:
            self._gates[tag] = asyncio.Event()
        return self._gates[tag]

    def release(self, tag: str) -> None:
        self._loop.call_soon_threadsafe(lambda: self._gate(tag).set())

    def add_routes(self, app) -> None:
        from aiohttp import web

        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            tag = body["messages"][0]["content"]
            if not body.get("stream"):  # the console counting a prompt the engine did not report: at once
                return web.json_response({"object": "chat.completion", "choices": [], "usage": {
                    "prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
            self.arrived.append(tag)
            if tag.startswith("hold"):  # a long prefill: no answer at all until released
                await self._gate(tag).wait()
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": tag}}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await self._gate(tag).wait()
            if (body.get("stream_options") or {}).get("include_usage"):  # as the engines do when asked
                usage = {"object": "chat.completion.chunk", "choices": [],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
                await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response

        app.router.add_post("/v1/chat/completions", chat)


@pytest.fixture(scope="module")
def gate_backend() -> Iterator[GateBackend]:
    backend = GateBackend()
    yield backend
    backend.stop()


@pytest.fixture(scope="module")
def queued(tmp_path_factory, gate_backend) -> Iterator[ProxyConsole]:
    console = start_console(tmp_path_factory.mktemp("queue-console"), server="uvicorn", extra_env={
        "XGEN_NODE_STALE_AFTER": "3600", "XGEN_NODE_OFFLINE_AFTER": "7200", "XGEN_QUEUE_MAX": "2",
        "XGEN_QUEUE_TIMEOUT_S": "120"})
    try:
        key = console.manage("createapikey", "--username", "admin").stdout.split()[-1]
        pc = ProxyConsole(console=console, key=key)
        pc.keys = {p: console.manage("createapikey", "--username", "admin", "--name", p, "--priority", p)
                   .stdout.split()[-1] for p in ("high", "low")}
        pc.set_instances([{"name": MODEL, "port": gate_backend.port, "max_concurrency": 1}])
        pc.wait_models({MODEL})
        yield pc
    finally:
        code = stop_process(console.proc, timeout=30)
    assert code == 0, console.log[-3000:]
    assert "proxy failed" not in console.log and "Traceback" not in console.log, console.log[-5000:]


class Stream(threading.Thread):
    """One streamed request in its own thread; `status`, `headers` and the text it received."""

    def __init__(self, pc: ProxyConsole, tag: str, key: str | None = None) -> None:
        super().__init__(daemon=True)
        self.pc, self.tag, self.key = pc, tag, key or pc.key
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.text = ""
        self.start()

    def run(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": self.tag}], "stream": True}
        with httpx.stream("POST", f"{self.pc.url}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {self.key}"}) as r:
            self.status, self.headers = r.status_code, r.headers
            self.text = "".join(r.iter_text())


def _gauge(pc: ProxyConsole, family: str, labels: str) -> float:
    """The model's value of a gauge family on /metrics (0 when absent); `labels` a regex."""
    text = httpx.get(f"{pc.url}/metrics", headers=pc.auth, timeout=10).text
    found = re.search(rf'^{family}\{{{labels}\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _depth(pc: ProxyConsole) -> float:
    return _gauge(pc, "xgen_queue_depth", f'model="{MODEL}"')


def _in_flight(pc: ProxyConsole) -> float:
    return _gauge(pc, "xgen_inference_in_flight", rf'instance="\d+",model="{MODEL}"')


def _until(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_overflow_gets_429_queue_full_the_rest_complete_in_order_and_high_priority_overtakes(queued, gate_backend):
    pc, backend = queued, gate_backend
    first = Stream(pc, "r1")
    _until(lambda: backend.arrived == ["r1"], "the first request reaches the backend")
    waiting = [Stream(pc, "r2", pc.keys["low"])]
    _until(lambda: _depth(pc) == 1, "r2 waits in the queue")
    waiting.append(Stream(pc, "r3", pc.keys["low"]))
    _until(lambda: _depth(pc) == 2, "r3 waits in the queue")
    # The key holding every place asks again: refused (another key would have pushed one of its places out).
    overflow = [Stream(pc, f"r{i}", pc.keys["low"]) for i in (4, 5, 6)]
    for s in overflow:
        s.join(30)
        assert s.status == 429, (s.tag, s.status, s.text)
        error = json.loads(s.text)["error"]
        assert error["code"] == "queue_full" and int(s.headers["retry-after"]) >= 1
    assert backend.arrived == ["r1"], "nothing past the queue reached the backend"
    backend.release("r1")
    _until(lambda: backend.arrived == ["r1", "r2"], "r2 is served after r1")
    high = Stream(pc, "r7", pc.keys["high"])
    _until(lambda: _depth(pc) == 2, "r7 waits behind r3 in arrival, ahead of it in priority")
    backend.release("r2")
    _until(lambda: len(backend.arrived) == 3, "the next one is served")
    assert backend.arrived == ["r1", "r2", "r7"], "the high-priority key's request overtakes the low one"
    backend.release("r7")
    _until(lambda: backend.arrived == ["r1", "r2", "r7", "r3"], "r3 last")
    backend.release("r3")
    for s in [first, *waiting, high]:
        s.join(30)
        assert s.status == 200 and f'"content": "{s.tag}"' in s.text and s.text.rstrip().endswith("[DONE]"), s.text
    assert _depth(pc) == 0


@contextlib.contextmanager
def _raw_stream_request(pc: ProxyConsole, tag: str) -> Iterator[None]:
    """A stream request sent on a bare socket, which the client leaves (closes) on exit."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": tag}], "stream": True}).encode()
    host, port = pc.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + pc.key.encode() + b"\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        yield


def test_a_client_that_leaves_the_queue_leaves_nothing_behind(queued, gate_backend):
    pc, backend = queued, gate_backend
    backend.arrived.clear()
    holder = Stream(pc, "h1")
    _until(lambda: backend.arrived == ["h1"], "h1 holds the one slot")
    with _raw_stream_request(pc, "gone"):
        _until(lambda: _depth(pc) == 1, "the request waits in the queue")
    _until(lambda: _depth(pc) == 0, "the client that left is no longer queued")
    backend.release("h1")
    holder.join(30)
    assert holder.status == 200
    after = Stream(pc, "h2")
    _until(lambda: backend.arrived == ["h1", "h2"], "the slot was given back: the next request is served at once")
    backend.release("h2")
    after.join(30)
    assert after.status == 200 and "gone" not in backend.arrived


def test_a_client_that_leaves_before_the_backend_answers_frees_its_slot(queued, gate_backend):
    """The watch for a client leaving starts late (WATCH_AFTER_S) but it starts: a backend that
    has not sent a byte (a long prefill) no longer holds the slot once its client is gone."""
    pc, backend = queued, gate_backend
    backend.arrived.clear()
    with _raw_stream_request(pc, "hold-1"):
        _until(lambda: backend.arrived == ["hold-1"], "the backend has the request")
        time.sleep(0.3)  # past the watch's start
        assert _in_flight(pc) == 1
    _until(lambda: _in_flight(pc) == 0, "the proxy let go of the request its client left")
    after = Stream(pc, "h3")  # max_concurrency 1: served at once only if the slot came back
    _until(lambda: backend.arrived == ["hold-1", "h3"], "the next request is served while the backend still holds")
    backend.release("h3")
    after.join(30)
    backend.release("hold-1")
    assert after.status == 200
