"""The request head on the default server (uvicorn, `manage.py serve`): a deadline, a size cap
and a cap on open connections (issue 34 #16), against a real server process over raw sockets.

The console runs with XGEN_HEAD_TIMEOUT=2 and XGEN_MAX_CONNECTIONS=4; the head cap is the
default 64 KiB. Each case closes its sockets before the next one starts.
"""
from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.conftest import Console, start_console
from tests.procs import stop_process

DEADLINE_S = 2
MAX_CONNECTIONS = 4
MAX_HEAD = 64 * 1024
WAIT_S = 15.0  # what a test waits at most for the server to act; a socket timeout fails it


@pytest.fixture(scope="module")
def edge(tmp_path_factory) -> Iterator[Console]:
    console = start_console(tmp_path_factory.mktemp("edge"), server="uvicorn",
                            extra_env={"XGEN_HEAD_TIMEOUT": str(DEADLINE_S),
                                       "XGEN_MAX_CONNECTIONS": str(MAX_CONNECTIONS)})
    try:
        yield console
    finally:
        code = stop_process(console.proc, timeout=30)
    assert code == 0, console.log[-3000:]


def _connect(console: Console) -> socket.socket:
    host, port = console.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    return sock


def _host(console: Console) -> str:
    return console.url.removeprefix("http://")


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (a socket timeout here: it never closed)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _read_answer(sock: socket.socket) -> tuple[int, bytes]:
    """One answer with a Content-Length body: (status, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ", 2)[1]), body


def _error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_a_connection_that_sends_nothing_is_closed_by_the_deadline(edge):
    with _connect(edge) as sock:
        started = time.monotonic()
        assert _read_all(sock) == b""  # closed without a word
        assert time.monotonic() - started >= DEADLINE_S - 0.5


def test_half_a_head_gets_408_at_the_deadline(edge):
    with _connect(edge) as sock:
        sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {_host(edge)}\r\n".encode())
        status, payload = _error(_read_all(sock))
    assert status == 408 and payload["error"]["code"] == "request_timeout"


def test_a_head_trickled_a_line_at_a_time_is_cut_off(edge):
    lines = [f"GET /healthz HTTP/1.1\r\nHost: {_host(edge)}\r\n".encode()] + [b"X-Slow: %d\r\n" % i for i in range(12)]
    with _connect(edge) as sock:
        sent = 0
        with contextlib.suppress(OSError):  # the server may close while a line is on its way
            for line in lines:
                sock.sendall(line)
                sent += 1
                time.sleep(0.5)  # 12 lines: 6 s in all, three times the deadline
                sock.settimeout(0.01)
                try:
                    if sock.recv(65536, socket.MSG_PEEK):
                        break
                except TimeoutError:
                    pass
                finally:
                    sock.settimeout(WAIT_S)
        answer = _read_all(sock)
    assert sent < len(lines), "the whole trickled head was taken"
    assert _error(answer)[0] == 408


def test_the_deadline_runs_again_after_each_answer(edge):
    with _connect(edge) as sock:
        sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {_host(edge)}\r\n\r\n".encode())
        assert _read_answer(sock)[0] == 200
        sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {_host(edge)}\r\n".encode())  # and then nothing
        started = time.monotonic()
        rest = _read_all(sock)
    assert _error(rest)[0] == 408 and time.monotonic() - started >= DEADLINE_S - 0.5


def test_a_head_over_the_cap_is_refused_431_before_the_rest_is_sent(edge):
    start = f"GET /v1/models HTTP/1.1\r\nHost: {_host(edge)}\r\nX-Big: ".encode()
    with _connect(edge) as sock:
        # 64 KiB + 1 KiB of a 128 KiB header, and no more: the answer comes without the rest.
        sock.sendall(start + b"a" * (MAX_HEAD + 1024 - len(start)))
        status, payload = _error(_read_all(sock))
    assert status == 431 and payload["error"]["code"] == "request_header_too_large"
    assert set(payload["error"]) == {"message", "type", "code"}
    with _connect(edge) as sock, contextlib.suppress(OSError):  # the whole 128 KiB at once
        sock.sendall(start + b"a" * (128 * 1024) + b"\r\n\r\n")
        assert _error(_read_all(sock))[0] == 431


def test_a_head_under_the_cap_is_served(edge):
    head = f"GET /healthz HTTP/1.1\r\nHost: {_host(edge)}\r\nX-Big: {'a' * (MAX_HEAD - 200)}\r\n\r\n".encode()
    assert len(head) < MAX_HEAD
    with _connect(edge) as sock:
        sock.sendall(head)
        assert _read_answer(sock)[0] == 200


def test_connections_past_the_cap_get_503(edge):
    idle = [_connect(edge) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)  # accepted by the server
        with _connect(edge) as extra:
            extra.sendall(f"GET /healthz HTTP/1.1\r\nHost: {_host(edge)}\r\n\r\n".encode())
            status, body = _read_answer(extra)
        assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections"
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + WAIT_S
    while True:  # once the idle ones are gone, a request is served again
        with _connect(edge) as sock:
            sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {_host(edge)}\r\n\r\n".encode())
            status, _ = _read_answer(sock)
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 200


def test_a_websocket_handshake_still_upgrades(edge):
    head = (f"GET /ws/instances/ HTTP/1.1\r\nHost: {_host(edge)}\r\nOrigin: http://{_host(edge)}\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n").encode()
    with _connect(edge) as sock:
        sock.sendall(head)
        first = sock.recv(65536)
    # Anonymous: the consumer refuses it, over the websocket protocol (101 then a close) or as a 403.
    assert first.startswith((b"HTTP/1.1 101", b"HTTP/1.1 403")), first[:200]
