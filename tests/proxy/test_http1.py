"""The proxy's HTTP/1.1 client (serving.proxy.http1) against a real loopback server that answers
each connection from a script: framing (length, chunked, until close), keep-alive reuse, and
every way a backend can fail, told apart as the proxy needs them."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from serving.proxy import http1


class Backend:
    """A TCP server on loopback; each request read is answered by `answer(request, writer)`."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> Backend:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                if await self.answer(request, writer) == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # the test's loop closing: ended quietly (3.11's start_server logs a cancelled handler)
        finally:
            writer.close()


def fixed(data: bytes):
    async def answer(request, writer):
        writer.write(data)
        await writer.drain()
    return answer


JSON_OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: 11\r\n\r\n{"ok":true}'


@pytest.fixture
async def client():
    c = http1.Client(connect_timeout_s=2)
    yield c
    await c.close()


async def test_length_delimited_answers_reuse_one_connection(client):
    async with Backend(fixed(JSON_OK)) as backend:
        for _ in range(3):
            response = await client.post(backend.url, "/v1/chat/completions?x=1", b'{"a":1}',
                                         b"content-type: application/json\r\nx-request-id: r1\r\n")
            assert (response.status, response.content_type, response.content_length) == (200, "application/json", 11)
            assert await response.read() == b'{"ok":true}'
            assert response.at_eof()
            response.release()
        assert backend.connections == 1
        assert client.stats() == (1, 0)
        first = backend.requests[0]
        assert first.startswith(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n")
        assert f"host: 127.0.0.1:{backend.port}\r\n".encode() in first
        assert b"content-length: 7\r\n" in first and b"x-request-id: r1\r\n" in first
        assert first.endswith(b'\r\n\r\n{"a":1}')


async def test_chunked_stream_arrives_as_it_is_sent(client):
    step = asyncio.Event()

    async def answer(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"7\r\ndata: 1\r\n")
        await writer.drain()
        await step.wait()
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await writer.drain()

    async with Backend(answer) as backend:
        response = await client.post(backend.url, "/v1/completions", b"{}", b"")
        assert response.content_type == "text/event-stream" and response.content_length is None
        chunks = response.iter_any()
        assert await asyncio.wait_for(chunks.__anext__(), 2) == b"data: 1"  # before the rest exists
        assert not response.at_eof()
        step.set()
        assert b"".join([c async for c in chunks]) == b"data: 2"
        assert response.at_eof()
        response.release()
        assert client.stats() == (1, 0)


async def test_body_until_close_ends_cleanly_and_is_not_pooled(client):
    async def answer(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npart one, ")
        await writer.drain()
        writer.write(b"part two")
        await writer.drain()
        return "close"

    async with Backend(answer) as backend:
        response = await client.post(backend.url, "/x", b"", b"")
        assert await response.read() == b"part one, part two"
        response.release()
        assert client.stats() == (0, 0)


async def test_connection_close_answer_is_not_reused(client):
    async with Backend(fixed(JSON_OK.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))) as backend:
        for _ in range(2):
            response = await client.post(backend.url, "/x", b"", b"")
            assert await response.read() == b'{"ok":true}'
            response.release()
        assert backend.connections == 2


async def test_interim_100_continue_is_skipped(client):
    async with Backend(fixed(b"HTTP/1.1 100 Continue\r\n\r\n" + JSON_OK)) as backend:
        response = await client.post(backend.url, "/x", b"", b"")
        assert response.status == 200 and await response.read() == b'{"ok":true}'


async def test_refused_connection_is_connect_failed(client):
    async with Backend(fixed(JSON_OK)) as backend:
        url = backend.url
    with pytest.raises(http1.ConnectFailed, match="Cannot connect"):
        await client.post(url, "/x", b"", b"")


async def test_close_before_answering_is_disconnected_and_drops_idle_siblings(client):
    async def answer(request, writer):
        if b"die" in request:
            return "close"
        writer.write(JSON_OK)
        await writer.drain()

    async with Backend(answer) as backend:
        responses = await asyncio.gather(*(client.post(backend.url, "/x", b"ok", b"") for _ in range(3)))
        for response in responses:
            await response.read()
            response.release()
        assert client.stats() == (3, 0)
        with pytest.raises(http1.Disconnected):
            await client.post(backend.url, "/x", b"die", b"")
        assert client.stats() == (0, 0)  # the pooled siblings of a dropped connection are not trusted


async def test_close_mid_body_is_broken_after_the_bytes_that_came(client):
    async def answer(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhalf")
        await writer.drain()
        return "close"

    async with Backend(answer) as backend:
        response = await client.post(backend.url, "/x", b"", b"")
        got = []
        with pytest.raises(http1.Broken, match="mid-answer"):
            async for chunk in response.iter_any():
                got.append(chunk)
        assert got == [b"half"]
        response.release()
        assert client.stats() == (0, 0)


async def test_garbage_is_broken(client):
    async with Backend(fixed(b"SSH-2.0-OpenSSH\r\n\r\n")) as backend:
        with pytest.raises(http1.Broken, match="not valid HTTP"):
            await client.post(backend.url, "/x", b"", b"")
        assert client.stats() == (0, 0)


def writes_as_fast_as_it_can(size: int):
    """An answer of `size` bytes written 64 KiB at a time, each write waiting for the reader."""
    async def answer(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()
    return answer


async def test_a_slow_reader_pauses_the_backend_instead_of_buffering(client):
    size = 8 * http1.READ_HIGH
    async with Backend(writes_as_fast_as_it_can(size)) as backend:
        response = await client.post(backend.url, "/x", b"", b"")
        # Nobody reads: the connection stops reading once READ_HIGH bytes wait (polled, not timed),
        # and what waits stays bounded while the backend would go on writing.
        deadline = asyncio.get_running_loop().time() + 10
        while not response._conn.paused:
            assert asyncio.get_running_loop().time() < deadline, response._size
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        assert response._size <= http1.READ_HIGH + 65536 * 4
        total = 0
        async for chunk in response.iter_any():
            total += len(chunk)
        assert total == size
        response.release()
        assert client.stats() == (1, 0)


async def test_cancelled_request_closes_its_connection(client):
    async def answer(request, writer):
        await asyncio.sleep(5)

    async with Backend(answer) as backend:
        task = asyncio.create_task(client.post(backend.url, "/x", b"", b""))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client.stats() == (0, 0)


async def test_idle_connections_close_after_keepalive(client, monkeypatch):
    monkeypatch.setattr(http1, "KEEPALIVE_S", 0.2)
    async with Backend(fixed(JSON_OK)) as backend:
        response = await client.post(backend.url, "/x", b"", b"")
        await response.read()
        response.release()
        assert client.stats() == (1, 0)
        await asyncio.sleep(0.5)
        assert client.stats() == (0, 0)


async def test_a_connection_idle_near_the_engines_keepalive_is_not_reused(client):
    """llama-server and uvicorn (llama-cpp-python, vLLM) close a connection idle for 5 s; a reuse
    near that instant can cross their close and end in a 502. A connection idle 4.2 s is closed,
    not reused: the second request opens a new one (the backend here never closes on its own)."""
    async with Backend(fixed(JSON_OK)) as backend:
        for pause in (0, 4.2):
            await asyncio.sleep(pause)
            response = await client.post(backend.url, "/x", b"", b"")
            await response.read()
            response.release()
        assert backend.connections == 2


async def test_a_target_with_unsafe_bytes_is_quoted(client):
    async with Backend(fixed(JSON_OK)) as backend:
        response = await client.post(backend.url, "/x?q=a b\r\nx", b"", b"")
        await response.read()
        assert backend.requests[0].startswith(b"POST /x?q=a%20b%0D%0Ax HTTP/1.1\r\n")


async def test_backend_connections_probe_a_silent_peer(client):
    """Nothing bounds the wait for an answer (a prefill can take minutes): TCP keepalive finds a
    backend host that vanished without closing."""
    import socket

    async with Backend(fixed(JSON_OK)) as backend:
        response = await client.post(backend.url, "/x", b"", b"")
        sock = response._conn.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == http1.TCP_IDLE_S
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == http1.TCP_INTERVAL_S
        await response.read()


# ---------------------------------------------------------------- issue 23, item 1
CHUNKED_WITH_TRAILER = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n"
                        b"Trailer: x-t\r\n\r\n2;ext=1\r\nhi\r\n0\r\nx-t: v\r\nx-u: w\r\n\r\n")


async def test_trailers_never_become_the_next_answers_headers(client):
    """Before: trailer fields were appended after the head's list was handed over, so the next
    answer on the pooled connection began with them ([(b'x-t', b'v'), (b'content-length', ...)])."""
    answers = iter([CHUNKED_WITH_TRAILER, JSON_OK])

    async def answer(request, writer):
        writer.write(next(answers))
        await writer.drain()

    async with Backend(answer) as backend:
        first = await client.post(backend.url, "/x", b"", b"")
        assert await first.read() == b"hi"
        first.release()
        second = await client.post(backend.url, "/x", b"", b"")
        assert second.headers == [(b"content-type", b"application/json; charset=utf-8"), (b"content-length", b"11")]
        assert await second.read() == b'{"ok":true}'
        assert backend.connections == 1


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (70 * 1024) + b"\r\nContent-Length: 2\r\n\r\nok",  # one big field
    b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(101)) + b"Content-Length: 2\r\n\r\nok",
])
async def test_an_oversized_head_is_refused_and_its_connection_closed(client, head):
    async with Backend(fixed(head)) as backend:
        with pytest.raises(http1.Broken, match="head is over"):
            await client.post(backend.url, "/x", b"", b"")
        assert client.stats() == (0, 0)
        # A head at the caps passes.
        fields = b"".join(b"X-%d: v\r\n" % i for i in range(http1.MAX_HEADERS - 1))
    async with Backend(fixed(b"HTTP/1.1 200 OK\r\n" + fields + b"Content-Length: 2\r\n\r\nok")) as backend:
        response = await client.post(backend.url, "/x", b"", b"")
        assert len(response.headers) == http1.MAX_HEADERS and await response.read() == b"ok"


async def test_a_head_that_never_ends_is_refused_while_it_arrives(client):
    """Header lines sent without end (read after read): refused once MAX_HEAD_BYTES came, not
    buffered until the backend stops."""
    sent = []

    async def answer(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(10_000):
            writer.write(b"X-%d: %s\r\n" % (i, b"v" * 100))
            sent.append(i)
            await writer.drain()
            await asyncio.sleep(0)
        return "close"

    async with Backend(answer) as backend:
        with pytest.raises(http1.Broken, match="head is over"):
            await asyncio.wait_for(client.post(backend.url, "/x", b"", b""), 10)
        assert len(sent) < 10_000 and client.stats() == (0, 0)


async def test_endless_interim_answers_are_refused(client):
    async with Backend(fixed(b"HTTP/1.1 100 Continue\r\n\r\n" * 10_000)) as backend:
        with pytest.raises(http1.Broken, match="head is over"):
            await asyncio.wait_for(client.post(backend.url, "/x", b"", b""), 10)


async def test_endless_trailers_are_refused(client):
    async def answer(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\nX-T: ")
        for _ in range(200):
            writer.write(b"v" * 1024)
            await writer.drain()
            await asyncio.sleep(0)
        return "close"

    async with Backend(answer) as backend:
        response = await client.post(backend.url, "/x", b"", b"")
        with pytest.raises(http1.Broken, match="without any of the body"):
            await asyncio.wait_for(response.read(), 10)


async def test_pools_are_dropped_once_they_hold_no_connection(client, monkeypatch):
    """Before: one pool per address ever seen stayed in Client._pools for the process's life."""
    monkeypatch.setattr(http1, "KEEPALIVE_S", 0.2)
    async with Backend(fixed(JSON_OK)) as one, Backend(fixed(JSON_OK)) as two, \
            Backend(fixed(JSON_OK.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))) as closing:
        for backend in (one, two, closing):
            response = await client.post(backend.url, "/x", b"", b"")
            await response.read()
            response.release()
        assert sorted(client._pools) == sorted([one.url, two.url])  # the closed one's pool went with it
        url = one.url
        await asyncio.sleep(0.5)  # past the keep-alive: idle connections closed, their pools dropped
        assert client._pools == {} and client.stats() == (0, 0)
    with pytest.raises(http1.ConnectFailed):
        await client.post(url, "/x", b"", b"")
    assert client._pools == {}


async def test_headers_named_in_connection_are_not_the_clients(client):
    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive, X-Hop,\r\n"
              b"X-Kept: 1\r\nx-hop: secret\r\nConnection: Cache-Control\r\nCache-Control: private\r\n"
              b"Keep-Alive: timeout=5\r\nContent-Length: 2\r\n\r\n{}")
    async with Backend(fixed(answer)) as backend:
        response = await client.post(backend.url, "/x", b"", b"")
        names = [name for name, _ in response.headers]
        assert names == [b"content-type", b"connection", b"x-kept", b"connection", b"content-length"]
        assert await response.read() == b"{}" and response.keep_alive


async def test_an_early_answer_leaves_its_connection_out_of_the_pool(client):
    """A backend answering (413) before it read the body: the rest of the body may still be in
    the client's write buffer; reused, those bytes would reach the backend as the next request."""
    big = b"x" * (32 << 20)

    async def answer(request, writer):
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 2\r\n\r\nno")
        await writer.drain()
        await asyncio.sleep(1)

    async def head_only(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await answer(b"", writer)
        writer.close()

    server = await asyncio.start_server(head_only, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        response = await client.post(url, "/x", big, b"")
        assert response.status == 413 and await response.read() == b"no"
        response.release()
        assert client.stats() == (0, 0)
    finally:
        server.close()


# ---------------------------------------------------------------- issue 23: waits after the connect
@pytest.fixture
async def waits(monkeypatch):
    """`waits(first_byte_s=, idle_s=)`: a client with those waits, checked every 50 ms (closed after)."""
    monkeypatch.setattr(http1, "TICK_S", 0.05)
    made: list[http1.Client] = []

    def make(*, first_byte_s: float, idle_s: float) -> http1.Client:
        made.append(http1.Client(connect_timeout_s=2, first_byte_timeout_s=first_byte_s, idle_timeout_s=idle_s))
        return made[-1]

    yield make
    for client in made:
        await client.close()


async def test_a_backend_silent_after_the_request_is_a_first_byte_timeout(waits):
    client = waits(first_byte_s=0.3, idle_s=5)

    async def answer(request, writer):
        await asyncio.sleep(5)

    async with Backend(answer) as backend:
        started = asyncio.get_running_loop().time()
        with pytest.raises(http1.FirstByteTimeout, match="0.3 s"):
            await client.post(backend.url, "/x", b"", b"")
        assert asyncio.get_running_loop().time() - started < 4  # the wait ended it, not the backend
        assert client.stats() == (0, 0)


async def test_the_first_byte_wait_covers_a_stream_whose_headers_came_at_once(waits):
    """Engines send a stream's headers before the prefill: the first-byte wait runs until the
    first byte of the body, and a request's own (a model's) overrides the client's."""
    client = waits(first_byte_s=30, idle_s=30)

    async def answer(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async with Backend(answer) as backend:
        response = await client.post(backend.url, "/x", b"", b"", first_byte_timeout_s=0.3)
        with pytest.raises(http1.FirstByteTimeout):
            await asyncio.wait_for(response.read(), 4)
        assert client.stats() == (0, 0)


async def test_a_stream_that_stalls_midway_is_an_idle_timeout(waits):
    client = waits(first_byte_s=30, idle_s=0.3)

    async def answer(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(4):  # bytes 0.1 s apart: within the idle timeout, for longer than it
            writer.write(b"7\r\ndata: 1\r\n")
            await writer.drain()
            await asyncio.sleep(0.1)
        await asyncio.sleep(5)

    async with Backend(answer) as backend:
        response = await client.post(backend.url, "/x", b"", b"")
        got = []
        with pytest.raises(http1.IdleTimeout, match="0.3 s"):
            async for chunk in response.iter_any():
                got.append(chunk)
        assert b"".join(got) == b"data: 1" * 4
        assert client.stats() == (0, 0)


async def test_a_paused_reader_is_not_an_idle_backend(waits):
    """While the proxy stops reading (a slow client), the backend's silence is the proxy's doing."""
    client = waits(first_byte_s=30, idle_s=0.3)
    size = 4 * http1.READ_HIGH
    async with Backend(writes_as_fast_as_it_can(size)) as backend:
        response = await client.post(backend.url, "/x", b"", b"")
        while not response._conn.paused:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.8)  # paused past the idle timeout
        assert len(await asyncio.wait_for(response.read(), 10)) == size


# ---------------------------------------------------------------- issue 23: a POST never runs twice
async def test_a_close_after_the_request_was_read_is_not_safe_to_retry(client):
    """The backend read the request (it may have started the work), then closed: `retry_safe` is
    false, and open_upstream answers 502 instead of sending it again."""
    async with Backend(lambda request, writer: asyncio.sleep(0, "close")) as backend:
        with pytest.raises(http1.Disconnected) as caught:
            await client.post(backend.url, "/x", b'{"a":1}', b"")
        assert caught.value.retry_safe is False
        assert len(backend.requests) == 1


def _closing_backend():
    """A blocking loopback server (a thread) whose `close_all()` closes what it accepted, at once."""
    import socket

    accepted: list[socket.socket] = []
    requests: list[bytes] = []

    def answer_all(conn: socket.socket) -> None:
        data = b""
        while True:
            try:
                got = conn.recv(65536)
            except OSError:
                return
            if not got:
                return
            data += got
            while b"\r\n\r\n" in data:
                head, _, data = data.partition(b"\r\n\r\n")
                requests.append(head)
                try:
                    conn.sendall(JSON_OK)
                except OSError:  # close_all() shut the connection under it: what the test does on purpose
                    return

    def close_all() -> None:
        for conn in accepted:
            conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    listener, url = _threaded_server(answer_all, accepted)
    return listener, url, close_all, requests


def _threaded_server(handle, accepted: list | None = None):
    """A blocking loopback listener whose connections are each handled by `handle(conn)` in a thread."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if accepted is not None:
                accepted.append(conn)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener, f"http://127.0.0.1:{listener.getsockname()[1]}"


async def _pooled_then_closed(client: http1.Client, url: str, close_all) -> None:
    """One answer (its connection pooled), then the backend closes it while the event loop is
    busy: the pool has not seen the close."""
    import time

    response = await client.post(url, "/x", b"", b"")
    await response.read()
    response.release()
    close_all()
    time.sleep(0.2)  # the loop does not run: the connection still looks open to the pool


async def test_a_pooled_connection_closed_before_the_request_reached_it_is_safe_to_retry(client):
    """The backend closed its keep-alive connection just as the proxy reused it (here: while the
    event loop was busy, so the close was not yet seen): its kernel acknowledged none of the
    request, so the backend never read it: `retry_safe`."""
    listener, url, close_all, requests = _closing_backend()
    try:
        await _pooled_then_closed(client, url, close_all)
        with pytest.raises(http1.Disconnected) as caught:
            await client.post(url, "/x", b"", b"")
        assert caught.value.retry_safe is True
        assert len(requests) == 1
    finally:
        listener.close()


async def test_a_pooled_connection_seen_closed_before_reuse_is_not_used(client, monkeypatch):
    """Idle past PEEK_IDLE_S, a pooled connection is polled before reuse: the backend's close that
    the loop had not yet seen sends the request on a new connection, with nothing to retry."""
    monkeypatch.setattr(http1, "PEEK_IDLE_S", 0.0)
    listener, url, close_all, requests = _closing_backend()
    try:
        await _pooled_then_closed(client, url, close_all)
        response = await client.post(url, "/x", b"", b"")
        assert await response.read() == b'{"ok":true}'
        assert len(requests) == 2
    finally:
        listener.close()


async def test_a_timed_out_answer_stays_failed_when_its_close_follows(waits):
    """A body to the close, stalled: the idle timeout closes the connection, and that close must
    not then end the body as if the backend had (a truncated answer read as whole), nor replace
    the timeout with another error, when the reader comes back later."""
    client = waits(first_byte_s=30, idle_s=0.3)

    async def answer(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nthe start")
        await writer.drain()
        await asyncio.sleep(5)

    async with Backend(answer) as backend:
        response = await client.post(backend.url, "/x", b"", b"")
        chunks = response.iter_any()
        assert await chunks.__anext__() == b"the start"
        await asyncio.sleep(0.8)  # not reading: the wait fires, then the connection's close
        with pytest.raises(http1.IdleTimeout):
            await chunks.__anext__()


def _keepalive_backend(keepalive_s: float, closing_s: float):
    """A blocking loopback server that keeps a connection like cpp-httplib (llama-server): after an
    answer it waits `keepalive_s` for the next request, and closes when none came. Its close takes
    `closing_s` here (on a real server the window is microseconds, widened to be hit on purpose):
    a request that arrives meanwhile is acknowledged by the kernel, never read, and reset."""
    import socket

    requests: list[bytes] = []

    def keep(conn: socket.socket) -> None:
        import select
        import time

        with conn:
            while True:
                if not select.select([conn], [], [], keepalive_s)[0]:
                    time.sleep(closing_s)  # closing: what arrives now stays unread (a reset)
                    return
                data = conn.recv(65536)
                if not data:
                    return
                requests.append(data)
                conn.sendall(JSON_OK)

    listener, url = _threaded_server(keep)
    return listener, url, requests


async def test_keepalive_counts_from_the_backends_last_byte_not_from_the_readers_release(client, monkeypatch):
    """The backend's keep-alive clock starts when it has written its answer; a stream relayed to
    a slow client goes back to the pool only when the client has it all, later. Counted from that
    release, a connection the backend is closing was reused and the request reset (a 502 seen in
    rolling restarts under load); counted from the backend's last byte, it is not reused."""
    monkeypatch.setattr(http1, "KEEPALIVE_S", 0.4)
    listener, url, requests = _keepalive_backend(keepalive_s=0.5, closing_s=0.6)
    try:
        response = await client.post(url, "/x", b"", b"")
        await asyncio.sleep(0.3)  # the answer came at once; the reader takes it 0.3 s later
        assert await response.read() == b'{"ok":true}'
        response.release()
        await asyncio.sleep(0.35)  # 0.65 s after the backend's last byte: it is closing the connection
        response = await client.post(url, "/x", b"", b"")
        assert await response.read() == b'{"ok":true}'
        response.release()
        assert len(requests) == 2
    finally:
        listener.close()


def _chunked_answer(*, close_after: bool):
    """A streamed answer; `close_after`: the connection closed right after its 0-size chunk, with a
    Keep-Alive head, as llama-server (cpp-httplib) does after every streamed answer."""
    async def answer(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     b"Keep-Alive: timeout=5, max=100\r\n\r\n7\r\ndata: 1\r\n0\r\n\r\n")
        await writer.drain()
        return "close" if close_after else None
    return answer


async def test_a_backend_that_closes_after_each_stream_never_gets_a_request_on_a_closed_connection(client):
    """Each request follows the last answer at once (llama-server's replicas under load): before,
    the connection went back to the pool and the next request went out on it as the backend closed
    it (a 502 the client could not retry). Now a connection whose last answer was chunked is polled
    before reuse, and once the backend was seen closing after one, such connections are not pooled."""
    async with Backend(_chunked_answer(close_after=True)) as backend:
        for _ in range(30):
            response = await client.post(backend.url, "/v1/chat/completions", b"{}", b"")
            assert b"".join([c async for c in response.iter_any()]) == b"data: 1"
            response.release()
        assert len(backend.requests) == 30 and backend.connections == 30
        assert backend.url in client.closes_after_chunked
        assert client.stats() == (0, 0)  # nothing pooled that the backend closes anyway


async def test_a_backend_that_keeps_streamed_connections_keeps_its_pool(client):
    async with Backend(_chunked_answer(close_after=False)) as backend:
        for _ in range(5):
            response = await client.post(backend.url, "/v1/chat/completions", b"{}", b"")
            assert b"".join([c async for c in response.iter_any()]) == b"data: 1"
            response.release()
        assert backend.connections == 1 and client.closes_after_chunked == set()
        assert client.stats() == (1, 0)
