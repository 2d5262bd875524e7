"""Path tricks never reach a backend (issue 23 #3: `..`, `%2e%2e`, `//`, `;`, encoded slashes,
absolute-form targets): sent as raw bytes (an HTTP client would normalise them first) through a
real console (uvicorn and daphne) to a backend that records every request it gets. Each is refused
below 500 and the backend sees none of them; the same console forwards the route the trick is
made from, so the recorder is known to see what gets through."""
from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from tests.proxy.conftest import AiohttpBackend

# Each aims at a route the console never forwards (llama-server's /slots, /props, session routes)
# from one it does.
TRICKS = [
    "/api/inference/../slots",
    "/api/inference/%2e%2e/slots",
    "/api/inference/%2E%2E%2Fslots",
    "/api/inference//slots",
    "/api/inference/slots",
    "/api/inference/%73lots",
    "/api/inference/tokenize/../slots",
    "/api/inference/tokenize/..%2fslots",
    "/api/inference/tokenize%2f..%2fslots",
    "/api/inference/tokenize;/../slots",
    "/api/inference/tokenize/",
    "/api/inference/./tokenize",
    "/api/inference/v1/../../slots",
    "/v1/chat/completions/../../slots",
    "/v1/chat/completions/%2e%2e/%2e%2e/props",
    "/v1//chat/completions",
    "/v1/chat/completions;x=1",
    "/v1/chat/completions/",
    "/v1/chat/completions%00",
    "/v1/chat/completions/control",
    "/v1/streams/lookup",
    "/v1/./chat/completions",
    "/v1/%63hat/completions/../../../slots",
    "http://127.0.0.1/slots",
    "//slots",
    "/../slots",
    "*",
]


class RecordingBackend(AiohttpBackend):
    """Answers every method and path 200 JSON, and records (method, raw path) of each request."""

    def add_routes(self, app) -> None:
        from aiohttp import web

        self.seen: list[tuple[str, str]] = []

        async def anything(request: web.Request) -> web.Response:
            self.seen.append((request.method, request.raw_path))
            await request.read()
            return web.json_response({"tokens": [1, 2], "choices": [], "usage": {"prompt_tokens": 1,
                                                                                  "completion_tokens": 0}})

        app.router.add_route("*", "/{tail:.*}", anything)


@pytest.fixture(scope="module")
def recorder() -> Iterator[RecordingBackend]:
    backend = RecordingBackend()
    yield backend
    backend.stop()


@pytest.fixture(scope="module", params=["daphne", "uvicorn"])
def tricked(request, recorder):
    console = request.getfixturevalue("proxy_console_daphne" if request.param == "daphne" else "proxy_console")
    console.set_instances([{"name": "trick", "port": recorder.port, "backend": "llama-server"}])
    console.wait_models({"trick"})
    return console


def raw_post(console, target: str, body: dict) -> int:
    """Send POST `target` exactly as written; the answer's status."""
    payload = json.dumps(body).encode()
    host, port = console.url.removeprefix("http://").split(":")
    head = (f"POST {target} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: {console.auth['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + payload)
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    status_line = answer.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1."), (target, answer[:200])
    return int(status_line.split()[1])


@pytest.mark.parametrize("target", TRICKS)
def test_a_path_trick_reaches_no_backend(tricked, recorder, target):
    recorder.seen.clear()
    status = raw_post(tricked, target, {"model": "trick", "content": "a", "prompt": "a",
                                        "messages": [{"role": "user", "content": "a"}]})
    assert status != 200 and status < 500, (target, status)
    assert recorder.seen == [], (target, recorder.seen)


@pytest.mark.parametrize("target,upstream", [("/api/inference/tokenize", "/tokenize"),
                                             ("/v1/chat/completions", "/v1/chat/completions")])
def test_the_routes_the_tricks_start_from_are_forwarded(tricked, recorder, target, upstream):
    """The control: what the tricks are made from reaches the recorder, as exactly this path."""
    recorder.seen.clear()
    status = raw_post(tricked, target, {"model": "trick", "content": "a",
                                        "messages": [{"role": "user", "content": "a"}]})
    assert status == 200 and recorder.seen == [("POST", upstream)], (status, recorder.seen)
