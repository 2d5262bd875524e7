"""A backend whose stream is cut in the middle of an SSE event (a network fault, not a clean
kill between writes): the proxy's error event still arrives as an event of its own."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.faults.conftest import open_console

EVENT = b'data: {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'


class CuttingBackend:
    """Answers any request with an SSE stream (`payload`: by default one whole event and half of
    the next), then closes the socket without ending the chunked body."""

    def __init__(self) -> None:
        self.payload = EVENT + EVENT[:40]
        self.hold_s = 0.0  # keep the connection open this long after the payload
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    body += conn.recv(65536)
                payload = self.payload
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                             + f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
                if self.hold_s:
                    conn.settimeout(self.hold_s)
                    with contextlib.suppress(OSError):
                        conn.recv(1)  # returns when the proxy closes, or after hold_s

    def stop(self) -> None:
        self.sock.close()
        self.thread.join(5)


@pytest.fixture
def cutting_backend() -> Iterator[CuttingBackend]:
    backend = CuttingBackend()
    yield backend
    backend.stop()


def _stream_through_console(tmp_path, consoles, backend, server: str = "uvicorn", extra_env: dict | None = None):
    """A console routing model `cut` to `backend`; the console and the stream's SSE events."""
    c = open_console(tmp_path / "console", server=server,
                     extra_env={"XGEN_NODE_STALE_AFTER": "3600", "XGEN_NODE_OFFLINE_AFTER": "7200", **(extra_env or {})})
    consoles.append(c)
    c.set_instances([{"name": "cut", "port": backend.port}])
    c.wait_models({"cut"})
    body = {"model": "cut", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", f"{c.url}/v1/chat/completions", headers=c.auth, json=body, timeout=30) as r:
        assert r.status_code == 200
        text = r.read().decode()
    return c, [e for e in text.split("\n\n") if e.strip()]


@pytest.mark.parametrize("server", ["uvicorn", "daphne"])
def test_a_stream_cut_mid_event_still_ends_with_a_whole_error_event(tmp_path, consoles, cutting_backend, server):
    c, events = _stream_through_console(tmp_path, consoles, cutting_backend, server)
    assert events[0] == EVENT.decode().strip()
    error = json.loads(events[-1].removeprefix("data: "))  # an event of its own, not glued to the cut one
    assert error["error"]["code"] == "upstream_error", events
    assert c.stop() == 0


def test_a_stream_cut_after_done_is_complete_without_an_error_event(tmp_path, consoles, cutting_backend):
    cutting_backend.payload = EVENT + b"data: [DONE]\n\n"
    c, events = _stream_through_console(tmp_path, consoles, cutting_backend)
    assert events == [EVENT.decode().strip(), "data: [DONE]"], events  # the answer was whole: no error after it
    assert c.stop() == 0


def test_an_event_past_the_size_limit_ends_the_stream_with_an_error(tmp_path, consoles, cutting_backend):
    # 3 MiB with no blank line, then the backend keeps the stream open: the proxy must not wait
    # for (or keep rescanning) an event without end. Today's limit here: 1 MiB.
    cutting_backend.payload = EVENT + b"data: " + b"x" * (3 * 2**20)
    cutting_backend.hold_s = 60
    c, events = _stream_through_console(tmp_path, consoles, cutting_backend,
                                        extra_env={"XGEN_PROXY_MAX_SSE_EVENT": str(2**20)})
    assert events[0] == EVENT.decode().strip()
    error = json.loads(events[-1].removeprefix("data: "))
    assert error["error"]["code"] == "upstream_error" and "larger than 1048576 bytes" in error["error"]["message"]
    assert len(events) == 2  # nothing of the oversized event reached the client
    assert c.stop() == 0
