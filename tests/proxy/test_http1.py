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


async def test_a_slow_reader_pauses_the_backend_instead_of_buffering(client):
    size = 8 * http1.READ_HIGH

    async def answer(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()

    async with Backend(answer) as backend:
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
