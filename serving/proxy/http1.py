"""The proxy's HTTP/1.1 client for its backends: pooled keep-alive connections on asyncio
protocols, answers parsed by httptools (llhttp, the parser uvicorn already uses).

Why not aiohttp's client: on this path a request through aiohttp's ClientSession cost 113-122 us
of CPU against 34-37 us for this client (20,000 requests at concurrency 16 against the bench's
fast upstream, the same run); the proxy forwards bytes it already holds to a backend it knows,
so it needs none of a general client's cookies, redirects, URL building or header objects.

What it does: one request at a time per connection (no pipelining), a Host and Content-Length
of its own, the answer's headers as lower-cased bytes (those its `Connection` header names
dropped, and trailers never kept), its body as it arrives (chunked or length-delimited or up to
the close), read paused past READ_HIGH unread bytes (a slow client slows the backend, never the
proxy's memory), a head capped at MAX_HEAD_BYTES and MAX_HEADERS, idle connections kept
KEEPALIVE_S and closed when the backend closes them (one pool per backend address, dropped once
it holds none). Two waits bound a backend that stalls after the connect: the first byte of the
answer's body (a long prefill: the request's `first_byte_timeout_s`), then the silence between
bytes (`idle_timeout_s`); both are checked by one ticker per client, not a timer per request.
Failures come as errors the caller tells apart:
`ConnectFailed` (nothing was sent: try another replica), `Disconnected` (closed before the
answer's first byte; `retry_safe` when the backend provably never read the request, the only
case a POST may be sent again), `Broken` (the answer broke off, was not HTTP or was too large)
and `UpstreamTimeout` (`FirstByteTimeout`, `IdleTimeout`)."""
from __future__ import annotations

import asyncio
import re
import select
import socket
import struct
import time
from collections.abc import AsyncGenerator
from typing import cast
from urllib.parse import quote

import httptools

# An idle pooled connection is reused for at most this long: well under the 5 s after which the
# engines close an idle keep-alive connection (llama-server's cpp-httplib, and uvicorn under
# llama-cpp-python and vLLM). Reused closer to their close, a request can cross the backend's FIN
# on the wire; its bytes may be acknowledged before the close, so it cannot be proven unread and
# is not sent again (a 502). Idle counts from the answer's last byte as this process read it, which
# a busy event loop reads late: the 3 s margin covers that lag (4 s left 1 s, and a rolling restart
# on a loaded 2-core machine still met the race). A new loopback/LAN connection costs well under a
# millisecond.
KEEPALIVE_S = 2.0
READ_HIGH = 1 << 20  # unread answer bytes past which the connection stops reading (until they are taken)
MAX_HEAD_BYTES = 64 * 1024  # an answer's head (interim 1xx heads included); more is refused
MAX_HEADERS = 100  # header (or trailer) fields in one answer
PEEK_IDLE_S = 1.0  # a pooled connection idle longer than this is polled for the backend's close before reuse
# llama-server (cpp-httplib) closes the connection right after every chunked (streamed) answer,
# though its head says Keep-Alive: its content provider returns false once it called done(), and
# the server takes that for a failed write (measured: EOF 0.01-0.06 ms after the 0-size chunk).
# A request reusing the connection before the loop saw that close was read by no one and came back
# 502 (1 in ~800 streams in the replica tests, and in bench/replicas.py). So a connection whose
# last answer was chunked is polled before reuse (the FIN is in the kernel by then), and a backend
# seen closing a connection within this long of a chunked answer gets no such connection pooled
# again (the process remembers it by address).
CLOSES_AFTER_CHUNKED_S = 0.5
KNOWN_CLOSERS_MAX = 4096
TICK_S = 1.0  # how often the waits of the connections in use are checked
SAFE_TARGET_RE = re.compile(r"[!-~]*")  # printable ASCII without spaces: sent as it is
TCP_IDLE_S = 30  # keepalive probes after this much silence on a backend connection
TCP_INTERVAL_S = 10
_TCPI_BYTES_ACKED = 120  # offset of tcpi_bytes_acked (u64) in Linux's struct tcp_info


def _keepalive(sock: socket.socket) -> None:
    """TCP keepalive probes on a backend connection: a backend host that vanished without closing
    (power loss, a cut link) is found by the kernel within TCP_IDLE_S + 3 x TCP_INTERVAL_S, also
    while an answer waits inside its first-byte timeout."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, TCP_IDLE_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, TCP_INTERVAL_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    except OSError:
        pass


class UpstreamError(Exception):
    """A backend exchange failed."""


class ConnectFailed(UpstreamError):
    """No connection could be made (refused, unreachable, timed out): nothing was sent."""


class Disconnected(UpstreamError):
    """The connection closed before the answer's first byte. `retry_safe`: the backend's kernel
    acknowledged no byte of the request (it closed before the request arrived), so the backend
    cannot have read, let alone run, it; otherwise it may have, and a POST is not sent again."""

    def __init__(self, message: str, *, retry_safe: bool = False) -> None:
        super().__init__(message)
        self.retry_safe = retry_safe


class Broken(UpstreamError):
    """The answer broke off, or what came back was not HTTP (or a head over the caps)."""


class UpstreamTimeout(UpstreamError):
    """The backend went silent past one of the waits; the connection is closed."""


class FirstByteTimeout(UpstreamTimeout):
    """No byte of the answer's body (nor a whole empty answer) within the first-byte timeout."""


class IdleTimeout(UpstreamTimeout):
    """The answer's body had started, then nothing came for the idle timeout."""


class Response:
    """A backend's answer: status and headers at once, the body as it arrives."""

    __slots__ = ("status", "headers", "content_type", "content_length", "keep_alive", "_conn", "_chunks",
                 "_size", "_complete", "_error", "_waiter", "_until_close", "unsupported_coding", "chunked")

    def __init__(self, conn: _Connection, status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool) -> None:
        self.status = status
        self.keep_alive = keep_alive
        content_type = b""
        length: int | None = None
        coding: bytes | None = None
        named: list[bytes] | None = None
        for name, value in headers:
            if name == b"content-type":
                content_type = value
            elif name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = None
            elif name == b"transfer-encoding":
                coding = value if coding is None else coding + b"," + value
            elif name == b"connection":
                named = [*(named or ()), *value.lower().split(b",")]
        self.chunked = chunked = coding is not None and coding.strip().lower() == b"chunked"
        # Any other coding (gzip, or chunked after another) would reach the client still encoded.
        self.unsupported_coding = coding is not None and not chunked
        if named is not None:  # hop-by-hop by the backend's own word (RFC 9110 7.6.1): not the client's
            drop = {token.strip() for token in named}
            headers = [(k, v) for k, v in headers if k not in drop]
        self.headers = headers  # (lower-cased name, value), as bytes, in the order received
        self.content_type = content_type.split(b";", 1)[0].strip().lower().decode("latin-1")
        self.content_length = None if chunked else length
        # Neither a length nor chunked framing: the body ends when the backend closes.
        self._until_close = length is None and not chunked and status not in (204, 304)
        self._conn: _Connection | None = conn
        self._chunks: list[bytes] = []
        self._size = 0
        self._complete = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- fed by the connection
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > READ_HIGH and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _end(self, error: UpstreamError | None = None) -> None:
        if error is None:
            self._complete = True
        elif not self._complete and self._error is None:  # the first reason stands
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the caller
    def at_eof(self) -> bool:
        """Whether the whole body has arrived and been taken."""
        return self._complete and not self._chunks

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._size = 0
        if self._conn is not None:
            self._conn.resume()
        return data

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def iter_any(self) -> AsyncGenerator[bytes, None]:
        """The body's bytes as they arrive (what came since the last step, joined)."""
        while True:
            if self._chunks:
                yield self._take()
            elif self._complete:
                return
            elif self._error is not None:
                raise self._error
            else:
                await self._wait()

    async def read(self) -> bytes:
        """The whole body (taken as it arrives: a body over READ_HIGH must not pause its own read)."""
        parts = []
        while True:
            if self._chunks:
                parts.append(self._take())
            if self._complete:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            if self._error is not None:
                raise self._error
            await self._wait()

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool when the body was read to
        its end, the whole request went out (an early answer may leave part of its body unsent)
        and the backend keeps connections alive, and is closed otherwise."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._complete and self.keep_alive and not conn.closed and not conn.transport.get_write_buffer_size():
            conn.idle()
        else:
            conn.close()

    def close(self) -> None:
        """Close the connection now (the answer is not wanted any more)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a backend, carrying one exchange at a time."""

    def __init__(self, pool: _HostPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport  # set by connection_made, before create_connection returns it
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.paused = False
        self.idle_since = 0.0
        self.opened_at = time.monotonic()
        self.requests = 0  # sent on this connection, the current one included
        self.answered_at = 0.0  # monotonic time the last answer's final byte was read (0: not yet)
        self.last_chunked = False  # the last answer came chunked (see CLOSES_AFTER_CHUNKED_S)
        self.waiter: asyncio.Future[Response] | None = None  # the next answer's headers
        self.response: Response | None = None
        self.received = False  # any byte of the current answer
        self.body_bytes = 0  # of the current answer's body
        self.head_bytes = 0  # bytes read while the current answer's head was not complete
        self.bodiless_bytes = 0  # bytes read since the last that carried body (chunk framing, trailers)
        self.too_many = False  # the current message has more than MAX_HEADERS fields
        self.sent = 0  # request bytes written on this connection, this request's included
        self.sent_before = 0  # ... before this request
        self.sent_at = 0.0  # monotonic time of the current request
        self.last_read = 0.0  # monotonic time of the last bytes read (or of a resume)
        self.first_byte_s = 0.0
        self.idle_s = 0.0
        self._headers: list[tuple[bytes, bytes]] = []

    # -- asyncio
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP connection's
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _keepalive(sock)

    def data_received(self, data: bytes) -> None:
        if self.waiter is None and self.response is None:
            self.close()  # bytes nobody asked for: this connection is not reused
            return
        self.received = True
        self.last_read = time.monotonic()
        response = self.response
        if response is None:
            self.head_bytes += len(data)
        body_before = self.body_bytes
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(Broken("The backend switched protocols."))
        except httptools.HttpParserError as exc:
            self._fail(Broken(f"The backend's answer is not valid HTTP ({exc})."))
        else:
            if self.closed:
                return
            if response is None:
                if self.response is None and self.head_bytes > MAX_HEAD_BYTES:
                    self._fail(Broken(f"The backend's answer head is over {MAX_HEAD_BYTES} bytes."))
            elif self.body_bytes != body_before or response._complete:
                self.bodiless_bytes = 0
            else:
                # Reads without a body byte: chunk framing, extensions, trailers (which httptools
                # holds whole until each ends), bounded like a head.
                self.bodiless_bytes += len(data)
                if self.bodiless_bytes > MAX_HEAD_BYTES:
                    self._fail(Broken(f"The backend sent over {MAX_HEAD_BYTES} bytes without any of the body "
                                      f"(chunk extensions or trailers)."))

    def connection_lost(self, exc: Exception | None) -> None:
        by_backend = not self.closed  # close() marks the closes that are ours
        self.closed = True
        if by_backend and self.waiter is None and self.response is None:
            self.pool.learn_close(self)
        self.pool.forget(self)
        reason = f": {exc}" if exc else ""
        if self.waiter is not None:
            if self.received:
                self._fail(Broken(f"The backend closed the connection before answering{reason}."))
            else:
                self._fail(Disconnected(f"The backend closed the connection before answering{reason} "
                                        f"({self._story()}).", retry_safe=self._request_unread()))
        elif self.response is not None and not self.response._complete:
            if self.response._until_close and exc is None:
                self.response._end()
            else:
                self.response._end(Broken(f"The backend closed the connection mid-answer{reason}."))
        self.response = None

    def _story(self) -> str:
        """The connection's history, for the message of a close nobody can reproduce at will."""
        now = time.monotonic()
        idle = f", idle {self.sent_at - self.idle_since:.2f} s before it" if self.requests > 1 else ""
        return (f"request {self.requests} on a connection opened {now - self.opened_at:.2f} s before{idle}, "
                f"sent {now - self.sent_at:.3f} s before")

    def _request_unread(self) -> bool:
        """Whether the backend's kernel acknowledged no byte of the current request (Linux's
        tcpi_bytes_acked, which counts the SYN as one): then the backend closed before the request
        reached it. Read while the socket is still open (asyncio closes it after connection_lost);
        where it cannot be read, nothing is proven."""
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        try:
            raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except (AttributeError, OSError):
            return False
        if len(raw) < _TCPI_BYTES_ACKED + 8:
            return False
        return struct.unpack_from("Q", raw, _TCPI_BYTES_ACKED)[0] - 1 <= self.sent_before

    # -- httptools
    def on_message_begin(self) -> None:
        self._headers = []  # what a previous message left (its trailers) is not this one's
        self.too_many = False

    def on_header(self, name: bytes, value: bytes) -> None:
        # After the head, fields are a chunked body's trailers: collected here (up to the cap),
        # dropped at the next message's start, never a header of any answer.
        headers = self._headers
        if len(headers) < MAX_HEADERS:
            headers.append((name.lower(), value.rstrip(b" \t")))  # llhttp keeps a value's trailing OWS
        else:
            self.too_many = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        headers, self._headers = self._headers, []
        if self.too_many or (
                self.head_bytes > MAX_HEAD_BYTES and sum(len(k) + len(v) + 4 for k, v in headers) > MAX_HEAD_BYTES):
            self._fail(Broken(f"The backend's answer head is over {MAX_HEADERS} fields or {MAX_HEAD_BYTES} bytes."))
            return
        if 100 <= status < 200:
            return  # an interim answer (100 Continue, 103 Early Hints): the real one follows
        if self.waiter is None or self.waiter.done():  # an answer to nothing we asked, or the asker left
            self.waiter = None
            self.close()
            return
        response = Response(self, status, headers, self.parser.should_keep_alive())
        self.last_chunked = response.chunked
        if response.unsupported_coding:
            self._fail(Broken("The backend's answer has a transfer coding other than chunked."))
            return
        waiter, self.waiter = self.waiter, None
        self.response = response
        waiter.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.body_bytes += len(body)
            self.response._feed(body)

    def on_message_complete(self) -> None:
        self.answered_at = time.monotonic()  # the backend's keep-alive clock started by here
        response = self.response
        if response is not None and self.waiter is None:
            response._end()

    # -- the pool's side
    def _fail(self, error: UpstreamError) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        elif self.response is not None:
            self.response._end(error)
            self.response = None  # ended here: the close that follows cannot end it otherwise (cleanly)
        self.close()

    def check_waits(self, now: float) -> None:
        """Fail the exchange when the backend is silent past its wait: the first byte of the body
        (or a whole bodiless answer), then between bytes. Not while reading is paused (the
        silence is ours) or once the answer is complete."""
        response = self.response
        if self.closed or self.paused or (response is None and self.waiter is None) or (
                response is not None and response._complete):
            return
        if not self.body_bytes:
            if now - self.sent_at >= self.first_byte_s:
                self._fail(FirstByteTimeout(f"The backend sent no answer within {self.first_byte_s:g} s "
                                            f"(the first-byte timeout)."))
        elif now - self.last_read >= self.idle_s:
            self._fail(IdleTimeout(f"The backend sent nothing for {self.idle_s:g} s mid-answer "
                                   f"(the idle timeout)."))

    def pause(self) -> None:
        if not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.last_read = time.monotonic()  # the backend's silence counts from here
            self.transport.resume_reading()

    def idle(self) -> None:
        self.response = None
        self.received = False
        self.resume()
        self.pool.put(self)

    def peer_closed(self) -> bool:
        """Whether the idle connection became readable: the backend closed it (or sent bytes
        nobody asked for), seen before the event loop got to it."""
        try:
            poller = select.poll()
            poller.register(self.transport.get_extra_info("socket").fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (AttributeError, OSError, ValueError):
            return False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            self.transport.close()


class _HostPool:
    """The connections to one backend (host, port): idle ones newest last."""

    def __init__(self, client: Client, key: str, host: str, port: int) -> None:
        self.client = client
        self.key = key
        self.host = host
        self.port = port
        self.host_header = (f"[{host}]" if ":" in host else host).encode("idna") + f":{port}".encode()
        self.idle: list[_Connection] = []
        self.in_use: set[_Connection] = set()
        self.connecting = 0
        self._sweeper: asyncio.TimerHandle | None = None

    def take(self) -> _Connection | None:
        idle = self.idle
        now = time.monotonic()
        deadline = now - KEEPALIVE_S
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport.is_closing() or conn.idle_since < deadline or (
                    (conn.last_chunked or conn.idle_since < now - PEEK_IDLE_S) and conn.peer_closed()):
                self.learn_close(conn)
                conn.close()
                continue
            self.in_use.add(conn)
            return conn
        return None

    def learn_close(self, conn: _Connection) -> None:
        """An idle connection found closed by the backend: right after a chunked answer, this
        backend closes after every one (remembered for its address)."""
        if conn.last_chunked and conn.answered_at and time.monotonic() - conn.answered_at < CLOSES_AFTER_CHUNKED_S:
            closers = self.client.closes_after_chunked
            if self.key not in closers and len(closers) >= KNOWN_CLOSERS_MAX:
                closers.clear()  # addresses come and go (ports reused): forget, learn again
            closers.add(self.key)

    def put(self, conn: _Connection) -> None:
        if conn.last_chunked and self.key in self.client.closes_after_chunked:
            conn.close()  # the backend closes it anyway: not a connection to send the next request on
            return
        self.in_use.discard(conn)
        # Idle since the backend's last byte, not since the reader let go: a stream relayed to a slow
        # client comes back late, and the backend's keep-alive clock ran from its last write.
        now = time.monotonic()
        conn.idle_since = min(now, conn.answered_at) if conn.answered_at else now
        self.idle.append(conn)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(KEEPALIVE_S, self._sweep)

    def forget(self, conn: _Connection) -> None:
        self.in_use.discard(conn)
        try:
            self.idle.remove(conn)
        except ValueError:
            pass
        self.drop_if_empty()

    def drop_if_empty(self) -> None:
        """No connection left nor being made: the client keeps no pool for this address (a
        backend that moved or went away leaves nothing behind)."""
        if self.idle or self.in_use or self.connecting:
            return
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        pools = self.client._pools
        if pools.get(self.key) is self:
            del pools[self.key]

    def _sweep(self) -> None:
        """Close connections idle past KEEPALIVE_S (idle counts from the answer's last byte, so the
        list is not in idle_since order)."""
        self._sweeper = None
        deadline = time.monotonic() - KEEPALIVE_S
        for conn in [c for c in self.idle if c.idle_since <= deadline]:  # (not in idle_since order)
            conn.close()
        if self.idle:
            wait = min(c.idle_since for c in self.idle) + KEEPALIVE_S - time.monotonic()
            self._sweeper = asyncio.get_running_loop().call_later(max(wait, 0.1), self._sweep)
        else:
            self.drop_if_empty()

    def close_idle(self) -> None:
        for conn in list(self.idle):
            conn.close()

    def close(self) -> None:
        self.close_idle()
        for conn in list(self.in_use):
            conn.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


def _split_base(base_url: str) -> tuple[str, int]:
    """(host, port) of an `http://host:port` base URL."""
    if not base_url.startswith("http://"):
        raise ConnectFailed(f"Only http:// backends are supported, not {base_url!r}.")
    netloc = base_url[len("http://"):].split("/", 1)[0]
    host, sep, port = netloc.rpartition(":")
    if not sep or not port.isdigit():
        host, port = netloc, "80"
    return host.strip("[]"), int(port)


class Client:
    """The process's connections to its backends, one pool per (host, port) while it has any."""

    def __init__(self, *, connect_timeout_s: float, first_byte_timeout_s: float = 600.0,
                 idle_timeout_s: float = 300.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.closed = False
        self._pools: dict[str, _HostPool] = {}
        self._ticker: asyncio.TimerHandle | None = None
        self.closes_after_chunked: set[str] = set()  # backend addresses seen closing after chunked answers

    def _pool(self, base_url: str) -> _HostPool:
        pool = self._pools.get(base_url)
        if pool is None:
            pool = self._pools[base_url] = _HostPool(self, base_url, *_split_base(base_url))
        return pool

    async def _connect(self, pool: _HostPool) -> _Connection:
        loop = asyncio.get_running_loop()
        pool.connecting += 1
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(pool), pool.host, pool.port)
            if conn.closed:  # closed as it opened (connection_lost ran first): nothing was sent
                raise Disconnected(f"{pool.host}:{pool.port} closed the connection as it opened.", retry_safe=True)
            pool.in_use.add(conn)
            return conn
        except TimeoutError:
            raise ConnectFailed(f"Connecting to {pool.host}:{pool.port} timed out after "
                                f"{self.connect_timeout_s:g} s.") from None
        except OSError as exc:
            raise ConnectFailed(f"Cannot connect to {pool.host}:{pool.port}: {exc.strerror or exc}.") from None
        finally:
            pool.connecting -= 1
            pool.drop_if_empty()  # a failed (or cancelled) connect leaves no pool behind

    async def post(self, base_url: str, target: str, body: bytes, headers: bytes, *,
                   first_byte_timeout_s: float | None = None) -> Response:
        """POST `body` to `target` (path and query) on the backend at `base_url`, with `headers`
        (ready `name: value\\r\\n` lines, without Host and Content-Length); return at its headers.
        `first_byte_timeout_s` overrides the client's for this request (a model's own)."""
        if self.closed:
            raise ConnectFailed("The proxy is shutting down.")
        if not SAFE_TARGET_RE.fullmatch(target):
            target = quote(target, safe="/?&=%:+,;@!$'()*[]~-._")
        pool = self._pool(base_url)
        conn = pool.take() or await self._connect(pool)
        waiter = conn.waiter = asyncio.get_running_loop().create_future()
        conn.received = False
        conn.body_bytes = conn.head_bytes = conn.bodiless_bytes = 0
        conn.first_byte_s = first_byte_timeout_s or self.first_byte_timeout_s
        conn.idle_s = self.idle_timeout_s
        conn.sent_at = time.monotonic()
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().call_later(TICK_S, self._tick)
        head = b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n%s\r\n" % (
            target.encode("latin-1"), pool.host_header, len(body), headers)
        conn.sent_before = conn.sent
        conn.answered_at = 0.0
        conn.requests += 1
        conn.sent += len(head) + len(body)
        if len(body) < 65536:
            conn.transport.write(head + body)
        else:
            conn.transport.write(head)
            conn.transport.write(body)
        try:
            return await waiter
        except Disconnected:
            pool.close_idle()  # its siblings most likely went with it (a backend restart)
            raise
        except BaseException:
            conn.close()
            raise

    def _tick(self) -> None:
        """Check the waits of every connection in use; runs while any is."""
        self._ticker = None
        now = time.monotonic()
        busy = False
        for pool in list(self._pools.values()):
            for conn in list(pool.in_use):
                busy = True
                conn.check_waits(now)
        if busy and not self.closed:
            self._ticker = asyncio.get_running_loop().call_later(TICK_S, self._tick)

    def stats(self) -> tuple[int, int]:
        """(idle, in use) connections, over every backend."""
        return (sum(len(p.idle) for p in self._pools.values()), sum(len(p.in_use) for p in self._pools.values()))

    async def close(self) -> None:
        self.closed = True
        for pool in list(self._pools.values()):
            pool.close()
        self._pools.clear()
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        await asyncio.sleep(0)  # let the transports' close callbacks run
