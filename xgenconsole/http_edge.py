"""The web server's edge, before any request reaches the application: uvicorn's httptools protocol
with a deadline for the request head, a cap on its size and a cap on open connections.

uvicorn alone has none of the first two on httptools (h11 has a size cap only), so an anonymous
client could hold a connection by sending nothing or by trickling a head a line every few seconds
(its keep-alive timer restarts on every byte), and a 64 MiB header was buffered before the 401.

- Deadline: a head is complete within XGEN_HEAD_TIMEOUT seconds of the connection opening or of
  the previous answer on it; else the connection closes (408 first when part of a head came).
- Size: at most XGEN_MAX_HEAD_BYTES of request line and headers; the parser is fed no byte past
  the cap: 431, and the connection closes.
- Connections: past XGEN_MAX_CONNECTIONS open at once, a request is answered 503.
- Writes: a response's head goes out with its body's first bytes, in one write (one send() and
  one TCP segment where uvicorn makes two): a small answer, most of what the proxy relays, costs
  one syscall less. A head whose body is not sent in the same turn of the loop (a stream waiting
  for its first chunk) goes out at the next turn.

Daphne (twisted) is left as it is: its head cap is twisted's (16 KiB, a plain 400), its idle timeout
(60 s) restarts on every byte, and it has no cap on connections; `serve` says so at start.
"""
from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from accounts.errors import error_body

REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


def error_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 answer in the console's error shape, closing the connection."""
    body = json.dumps(error_body(message, status=status, code=code)).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, REASONS[status], len(body), body))


async def over_capacity(scope, receive, send) -> None:
    """The answer past XGEN_MAX_CONNECTIONS (in place of uvicorn's plain-text one)."""
    body = json.dumps(error_body("The server has too many open connections; try again shortly.", status=503,
                                 code="too_many_connections")).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})


class _HeldWrites:
    """Stands in for the transport while uvicorn's send() runs: what it writes (and a close) is held."""

    __slots__ = ("parts", "closed")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        self.closed = True


class OneWriteCycle(RequestResponseCycle):
    """uvicorn's request/response cycle, its response head held until the body's first message
    (see the module's docstring). uvicorn's send() does the HTTP (headers checked, Content-Length
    or chunked framing); it writes into _HeldWrites, and this class puts the bytes on the wire."""

    _held = b""  # the head, until the first body message (or the loop's next turn)
    _flush: asyncio.Handle | None = None

    async def send(self, message) -> None:  # type: ignore[override]
        starts = message["type"] == "http.response.start" and not self.response_started
        if not starts and not self._held:
            await super().send(message)
            return
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()  # here: uvicorn's send() below then runs without a pause
        transport, held = self.transport, _HeldWrites()
        self.transport = held  # type: ignore[assignment]
        try:
            await super().send(message)
        finally:
            self.transport = transport
        if starts:
            self._held = b"".join(held.parts)
            if self._held:
                self._flush = asyncio.get_running_loop().call_soon(self._write_held)
            return
        data, self._held = self._held + b"".join(held.parts), b""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        transport.write(data)
        if held.closed:
            transport.close()

    def _write_held(self) -> None:
        """The head alone: no body came in the turn that sent it."""
        self._flush = None
        if self._held:
            data, self._held = self._held, b""
            if not self.transport.is_closing():
                self.transport.write(data)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with the head deadline, the head size cap and the connection cap.

    The head's bytes are counted from the connection's start, and after each request's last byte
    (what follows is the next head); the deadline runs while no request is in progress.
    """

    head_timeout_s: float = 20.0
    max_head_bytes: int = 64 * 1024
    max_connections: int | None = None

    _head_bytes = 0
    _counting = False  # the bytes coming in belong to a head not yet complete
    _head_since: float | None = None  # when the deadline started (loop time); None: a request is in progress
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head()
        self._start_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._counting:  # a body, or bytes of a head already complete
            super().data_received(data)
            return
        if self.parser is None or self.transport.is_closing():
            return
        room = self.max_head_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        # Feed what fits under the cap; the rest only if the head ended within it.
        self._head_bytes += room
        if room > 0:
            super().data_received(data[:room])
        if self.transport.get_protocol() is not self or self.transport.is_closing() or self.parser is None:
            return  # upgraded to a websocket, or refused by uvicorn
        if self._counting:
            self._refuse(431, f"The request head exceeds {self.max_head_bytes} bytes.", "request_header_too_large")
            return
        super().data_received(data[room:])

    # Parser callbacks (httptools calls them inside feed_data)
    def on_headers_complete(self) -> None:
        self._counting = False
        self._head_since = None
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            app, self.app = self.app, over_capacity
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            return
        super().on_headers_complete()
        # The cycle uvicorn just made (its ASGI task not started yet: send is looked up when it
        # starts) writes each answer's head with its body (OneWriteCycle). A websocket upgrade
        # leaves no new cycle.
        if type(self.cycle) is RequestResponseCycle:
            self.cycle.__class__ = OneWriteCycle

    def on_message_complete(self) -> None:
        self._start_head()  # whatever comes next is the next request's head
        super().on_message_complete()

    def on_response_complete(self) -> None:
        waiting = bool(self.pipeline)
        super().on_response_complete()
        if self._counting and not waiting and not self.transport.is_closing():
            self._start_deadline()  # from the last answer

    # The deadline: one timer per connection, re-armed only when it fires early (a request answered
    # meanwhile moved the start on), so that a request costs a clock read, not a timer.
    def _start_head(self) -> None:
        self._counting = True
        self._head_bytes = 0

    def _start_deadline(self) -> None:
        self._head_since = self.loop.time()
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._check_deadline)

    def _check_deadline(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._head_since is None or not self._counting:
            return  # a request is in progress: its answer starts the deadline again
        left = self._head_since + self.head_timeout_s - self.loop.time()
        if left > 0:
            self._head_timer = self.loop.call_later(left, self._check_deadline)
        elif self._head_bytes:
            self._refuse(408, f"The request head did not arrive within {self.head_timeout_s:g} s.", "request_timeout")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str) -> None:
        self._counting = False
        self._head_since = None
        self.transport.write(error_response(status, message, code))
        self.transport.close()


def guarded_protocol(*, head_timeout_s: float, max_head_bytes: int,
                     max_connections: int | None) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...), with these limits."""
    return type("GuardedHttpTools", (GuardedHttpToolsProtocol,),
                {"head_timeout_s": float(head_timeout_s), "max_head_bytes": int(max_head_bytes),
                 "max_connections": max_connections})
