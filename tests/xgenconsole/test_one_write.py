"""A response's head and its body's first bytes in one write (xgenconsole.http_edge.OneWriteCycle):
uvicorn's cycle, as the console's protocol makes it, on a transport that records each write."""
from __future__ import annotations

import asyncio
import functools
import logging

from uvicorn.protocols.http.flow_control import FlowControl

from xgenconsole.http_edge import OneWriteCycle

HEAD_200 = b"HTTP/1.1 200 OK\r\n"


class Transport:
    """asyncio.Transport's calls a cycle makes, recorded: every write, and the close."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.events: list[str] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        assert not self.closing, "a write after the close"
        self.writes.append(data)
        self.events.append("write")

    def close(self) -> None:
        self.closing = True
        self.events.append("close")

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def cycle(transport: Transport, *, method: str = "POST", keep_alive: bool = True) -> OneWriteCycle:
    done: list[bool] = []
    one = OneWriteCycle(
        scope={"type": "http", "method": method, "path": "/v1/chat/completions", "http_version": "1.1",
               "headers": []},
        transport=transport, flow=FlowControl(transport), logger=logging.getLogger("test"),  # type: ignore[arg-type]
        access_logger=logging.getLogger("test.access"), access_log=False, default_headers=[],
        message_event=asyncio.Event(), expect_100_continue=False, keep_alive=keep_alive,
        on_response=lambda: done.append(True))
    one.done = done  # type: ignore[attr-defined]
    return one


def in_a_loop(test):
    """The test, a coroutine, run in a loop of its own."""
    return functools.wraps(test)(lambda: asyncio.run(test()))


def start(length: int | None = None) -> dict:
    headers = [(b"content-type", b"application/json")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http.response.start", "status": 200, "headers": headers}


@in_a_loop
async def test_a_whole_answer_is_one_write():
    transport = Transport()
    one = cycle(transport)
    await one.send(start(len(b'{"ok":1}')))
    assert transport.writes == []  # the head waits for the body
    await one.send({"type": "http.response.body", "body": b'{"ok":1}'})
    assert len(transport.writes) == 1, transport.writes
    head, _, body = transport.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(HEAD_200) and b"content-length: 8" in head and body == b'{"ok":1}'
    assert one.response_complete and one.done == [True]  # type: ignore[attr-defined]
    await asyncio.sleep(0)  # the next turn writes nothing more
    assert len(transport.writes) == 1


@in_a_loop
async def test_a_streams_head_goes_out_at_the_next_turn_then_each_chunk_as_it_comes():
    transport = Transport()
    one = cycle(transport)
    await one.send(start())  # no Content-Length: chunked
    assert transport.writes == []
    await asyncio.sleep(0)  # the first chunk is not there yet: the head goes alone
    assert len(transport.writes) == 1 and transport.writes[0].startswith(HEAD_200)
    assert b"transfer-encoding: chunked" in transport.writes[0]
    await one.send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    await one.send({"type": "http.response.body", "body": b"", "more_body": False})
    assert transport.writes[1:] == [b"9\r\ndata: 1\n\n\r\n", b"0\r\n\r\n"]


@in_a_loop
async def test_a_stream_whose_first_chunk_comes_in_the_same_turn_shares_the_heads_write():
    transport = Transport()
    one = cycle(transport)
    await one.send(start())
    await one.send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    assert len(transport.writes) == 1 and transport.writes[0].endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n")
    await asyncio.sleep(0)  # the head is not written twice
    assert len(transport.writes) == 1


@in_a_loop
async def test_a_connection_that_closes_after_the_answer_gets_it_first():
    transport = Transport()
    one = cycle(transport, keep_alive=False)
    await one.send(start(2))
    await one.send({"type": "http.response.body", "body": b"{}"})
    assert transport.events == ["write", "close"]
    assert b"connection: close\r\n" in transport.writes[0] and transport.writes[0].endswith(b"\r\n\r\n{}")


@in_a_loop
async def test_a_head_request_gets_its_head_alone():
    transport = Transport()
    one = cycle(transport, method="HEAD")
    await one.send(start(8))
    await one.send({"type": "http.response.body", "body": b""})
    assert len(transport.writes) == 1 and transport.writes[0].endswith(b"content-length: 8\r\n\r\n")


@in_a_loop
async def test_a_body_sent_while_the_client_reads_slowly_waits_for_the_drain_and_stays_in_order():
    transport = Transport()
    one = cycle(transport)
    await one.send(start(4))
    one.flow.pause_writing()  # the transport's buffer is full
    sending = asyncio.ensure_future(one.send({"type": "http.response.body", "body": b"abcd"}))
    await asyncio.sleep(0.01)
    assert not sending.done()
    assert len(transport.writes) == 1 and transport.writes[0].startswith(HEAD_200)  # the head went at the turn
    one.flow.resume_writing()
    await sending
    assert transport.writes[1:] == [b"abcd"]


@in_a_loop
async def test_a_client_gone_before_the_head_is_written_gets_nothing():
    transport = Transport()
    one = cycle(transport)
    await one.send(start())
    transport.closing = True  # the connection was lost
    await asyncio.sleep(0)
    assert transport.writes == []
