"""Request bodies are refused before they are read, on both servers `serve` offers (issue 17 #2).

Each case speaks raw HTTP over a socket: it sends the headers (and perhaps part of a body) and
then reads, so a server that waits for the whole body before answering is seen to hang.
"""
from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from tests.conftest import KeyedConsole, start_console
from tests.procs import stop_process

MAX_BODY = 256 * 1024
PROXY_MAX = 128 * 1024
BODY_TIMEOUT = 2
HUGE = 200 * 1024 * 1024


@pytest.fixture(scope="module", params=["uvicorn", "daphne"])
def guarded(request, tmp_path_factory) -> Iterator[KeyedConsole]:
    console = start_console(
        tmp_path_factory.mktemp(f"bodies-{request.param}"), server=request.param,
        extra_env={"XGEN_MAX_REQUEST_BODY": str(MAX_BODY), "XGEN_PROXY_MAX_BODY": str(PROXY_MAX),
                   "XGEN_BODY_TIMEOUT": str(BODY_TIMEOUT)},
    )
    try:
        console.manage("createuser", "--username", "opal", "--role", "operator", "--password", "opal-pass-123")
        key = console.manage("createapikey", "--username", "opal").stdout.strip().splitlines()[-1]
        yield KeyedConsole(console=console, key=key)
    finally:
        code = stop_process(console.proc, timeout=30)
    assert code == 0, console.log[-3000:]


def _exchange(console: KeyedConsole, head: str, body: bytes = b"", *, wait_s: float = 15.0) -> tuple[int, dict]:
    """Send `head` (+ `body`), then read the answer: (status, JSON body). A timeout fails the test."""
    host, port = console.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
            chunk = sock.recv(65536)  # socket.timeout here = the server waited for the body
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    payload = data.split(b"\r\n\r\n", 1)[1]
    return status, json.loads(payload) if payload.strip() else {}


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


def _head(method: str, path: str, console: KeyedConsole, *headers: str) -> str:
    host = console.url.removeprefix("http://")
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json", *headers]
    return "\r\n".join(lines) + "\r\n"


def _assert_error(status: int, payload: dict, want_status: int, code: str) -> None:
    assert status == want_status, payload
    assert set(payload["error"]) == {"message", "type", "code"}
    assert payload["error"]["code"] == code


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/management/load", "/accounts/login/"])
def test_a_huge_anonymous_body_is_refused_before_it_is_sent(guarded, path):
    status, payload = _exchange(guarded, _head("POST", path, guarded, f"Content-Length: {HUGE}"))
    assert status in (401, 413), payload
    assert set(payload["error"]) == {"message", "type", "code"}


def test_a_huge_body_with_a_valid_key_is_refused_by_its_length(guarded):
    auth = f"Authorization: Bearer {guarded.key}"
    for path, limit in (("/v1/chat/completions", PROXY_MAX), ("/api/management/load", MAX_BODY)):
        status, payload = _exchange(guarded, _head("POST", path, guarded, auth, f"Content-Length: {HUGE}"))
        _assert_error(status, payload, 413, "request_too_large")
        assert str(limit) in payload["error"]["message"]


def test_a_chunked_body_is_counted_as_it_arrives(guarded):
    chunk = b"x" * 8192
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(40))  # 320 KiB, no terminator
    head = _head("POST", "/accounts/login/", guarded, "Transfer-Encoding: chunked")
    status, payload = _exchange(guarded, head, body)  # anonymous: the login form's 64 KiB
    _assert_error(status, payload, 413, "request_too_large")


def test_a_trickled_body_times_out(guarded):
    head = _head("POST", "/api/management/load", guarded, f"Authorization: Bearer {guarded.key}",
                 "Content-Length: 1000")
    status, payload = _exchange(guarded, head, b'{"model_path": ', wait_s=BODY_TIMEOUT + 20)
    _assert_error(status, payload, 408, "request_timeout")


def test_a_body_within_the_limits_still_reaches_django(guarded):
    body = json.dumps({"model_path": "gguf/nope", "pad": "x" * (MAX_BODY // 2)}).encode()
    head = _head("POST", "/api/management/load", guarded, f"Authorization: Bearer {guarded.key}",
                 f"Content-Length: {len(body)}")
    status, payload = _exchange(guarded, head, body)
    assert status in (400, 404, 422), payload  # Django's own answer about the request, not a limit
    assert payload["error"]["code"] not in ("request_too_large", "request_timeout")
