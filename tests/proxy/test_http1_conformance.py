"""Conformance of the proxy's HTTP/1.1 client (serving.proxy.http1) with h11 as the reference
parser (issue 23): every framing, pooling across answers of every kind (the next answer on a
reused connection is exactly its own), an early answer, oversized and malformed heads, a backend
that stalls or closes at each point of an answer or sends garbage, and hypothesis-generated
answers, valid ones (status, headers and body identical to h11's reading) and broken ones (a
clean UpstreamError where h11 refuses them). Real loopback servers, the real client."""
from __future__ import annotations

import asyncio
import contextlib
import re

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.proxy import http1
from tests.proxy.test_http1 import JSON_OK, Backend

NEXT = JSON_OK  # the answer that follows on a reused connection


# ---------------------------------------------------------------- the reference
class Refused(Exception):
    """h11 does not take these bytes as one whole answer."""


def h11_answer(raw: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool]:
    """(status, headers, body, reusable) of `raw` as h11 reads it after a POST, the backend
    closing once `raw` is sent; Refused when h11 refuses it or the answer is not whole."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/x", headers=[("host", "b"), ("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw)
    status, headers, body, keep = 0, [], bytearray(), False
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                if conn.their_state is h11.DONE:
                    break
                conn.receive_data(b"")  # the close after `raw`
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                status, headers = event.status_code, [(k, v) for k, v in event.headers.raw_items()]
                headers = [(k.lower(), v) for k, v in headers]
                tokens = {t.strip() for k, v in headers if k == b"connection" for t in v.lower().split(b",")}
                # HTTP/1.0 keeps a connection only when it says keep-alive (RFC 9112 9.3; h11 never does).
                keep = b"close" not in tokens and (event.http_version == b"1.1" or b"keep-alive" in tokens)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                # A body ended by the close (no length, no chunking) cannot leave its connection open.
                framed = any(k in (b"content-length", b"transfer-encoding") for k, _ in headers) or \
                    status in (204, 304)
                return status, headers, bytes(body), keep and framed
            elif isinstance(event, h11.ConnectionClosed):
                raise Refused("closed before the answer")
    except h11.RemoteProtocolError as exc:
        raise Refused(str(exc)) from None
    raise Refused("not whole")


# ---------------------------------------------------------------- the client's side
async def client_answer(client: http1.Client, url: str) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool]:
    """(status, headers, body, pooled after) as the client reads it."""
    response = await client.post(url, "/x", b"", b"")
    try:
        body = await asyncio.wait_for(response.read(), 5)
    finally:
        response.release()
    return response.status, response.headers, body, client.stats()[0] == 1


def serve(answers: list[bytes]):
    """Answer the n-th request of a connection with answers[n]; close after the last one and
    after any that h11 says leaves no reusable connection (its body ends with the close)."""
    served = [0]

    def reusable(raw: bytes) -> bool:
        try:
            return h11_answer(raw)[3]
        except Refused:
            return False

    async def answer(request, writer):
        n = served[0]
        served[0] += 1
        raw = answers[min(n, len(answers) - 1)]
        writer.write(raw)
        await writer.drain()
        if n >= len(answers) - 1 or not reusable(raw):
            return "close"
    return answer


@pytest.fixture
async def client():
    c = http1.Client(connect_timeout_s=2)
    yield c
    await c.close()


def head(status: bytes = b"200 OK", *fields: bytes, version: bytes = b"HTTP/1.1") -> bytes:
    return version + b" " + status + b"\r\n" + b"".join(f + b"\r\n" for f in fields) + b"\r\n"


FRAMINGS: dict[str, bytes] = {
    "content-length": head(b"200 OK", b"Content-Type: application/json", b"Content-Length: 7") + b'{"a":1}',
    "content-length-0": head(b"200 OK", b"Content-Length: 0"),
    "chunked": head(b"200 OK", b"Transfer-Encoding: chunked") + b"3\r\nabc\r\n1\r\nd\r\n0\r\n\r\n",
    "chunked-ext-trailers": head(b"200 OK", b"Transfer-Encoding: chunked", b"Trailer: x-sum")
    + b"3;name=value;q=\"x y\"\r\nabc\r\nA;e\r\n0123456789\r\n0;last\r\nX-Sum: 13\r\nX-More: y\r\n\r\n",
    "chunked-empty": head(b"200 OK", b"Transfer-Encoding: chunked") + b"0\r\n\r\n",
    "chunked-upper-hex": head(b"200 OK", b"Transfer-Encoding: chunked") + b"1A\r\n" + b"z" * 26 + b"\r\n0\r\n\r\n",
    "close-delimited": head(b"200 OK", b"Content-Type: text/plain") + b"until the close",
    "http/1.0": head(b"200 OK", b"Content-Length: 2", version=b"HTTP/1.0") + b"ok",
    "http/1.0-until-close": head(b"200 OK", version=b"HTTP/1.0") + b"bytes to the end",
    "http/1.0-keep-alive": head(b"200 OK", b"Connection: keep-alive", b"Content-Length: 2", version=b"HTTP/1.0")
    + b"ok",
    "100-continue": head(b"100 Continue") + head(b"200 OK", b"Content-Length: 2") + b"ok",
    "103-early-hints": head(b"103 Early Hints", b"Link: </s.css>; rel=preload") + head(b"102 Processing")
    + head(b"201 Created", b"Content-Length: 2") + b"ok",
    "204": head(b"204 No Content", b"X-A: 1"),
    "304": head(b"304 Not Modified", b"ETag: \"x\"", b"Content-Length: 5"),  # the length of what is not sent
    "404-json": head(b"404 Not Found", b"Content-Type: application/json", b"Content-Length: 2") + b"{}",
    "500-chunked": head(b"500 Internal Server Error", b"Transfer-Encoding: chunked") + b"4\r\nfail\r\n0\r\n\r\n",
    "connection-close": head(b"200 OK", b"Connection: close", b"Content-Length: 2") + b"ok",
    "big": head(b"200 OK", b"Content-Length: %d" % (3 << 20)) + b"b" * (3 << 20),
    "ows-and-case": head(b"200 OK", b"X-Spaced: \t  value with  inner  spaces \t", b"CONTENT-length: 2") + b"ok",
    "empty-reason": b"HTTP/1.1 200 \r\nContent-Length: 2\r\n\r\nok",
}


@pytest.mark.parametrize("name", list(FRAMINGS))
async def test_every_framing_reads_as_h11_reads_it_and_the_next_answer_is_its_own(client, name):
    raw = FRAMINGS[name]
    status, headers, body, reusable = h11_answer(raw)
    async with Backend(serve([raw, NEXT])) as backend:
        got = await client_answer(client, backend.url)
        assert got == (status, headers, body, reusable)
        second = await client_answer(client, backend.url)
        assert second[:3] == (200, [(b"content-type", b"application/json; charset=utf-8"),
                                    (b"content-length", b"11")], b'{"ok":true}')
        assert backend.connections == (1 if reusable else 2)


async def test_one_connection_carries_every_kind_of_answer_each_its_own(client):
    kinds = [name for name in FRAMINGS if h11_answer(FRAMINGS[name])[3]]
    assert len(kinds) >= 12
    async with Backend(serve([FRAMINGS[name] for name in kinds] + [NEXT])) as backend:
        for name in kinds:
            assert await client_answer(client, backend.url) == h11_answer(FRAMINGS[name]), name
        assert (await client_answer(client, backend.url))[2] == b'{"ok":true}'
        assert backend.connections == 1


async def test_an_early_answer_while_the_body_is_sent_arrives_and_ends_the_connection(client):
    """A backend refusing a body (413) after reading only the head, then closing as servers
    should (its side shut, the rest of the body drained): the answer is the client's, the
    connection is not reused."""
    async def early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head(b"413 Content Too Large", b"Content-Length: 8", b"Connection: close") + b"too big!")
        await writer.drain()
        writer.write_eof()
        with contextlib.suppress(ConnectionError):
            while await reader.read(1 << 16):
                pass
        writer.close()

    server = await asyncio.start_server(early, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        response = await client.post(url, "/x", b"x" * (16 << 20), b"")
        assert response.status == 413 and await response.read() == b"too big!"
        response.release()
        assert client.stats() == (0, 0)
    finally:
        server.close()


# ---------------------------------------------------------------- a backend that closes at each point
@pytest.mark.parametrize("name", ["content-length", "chunked-ext-trailers", "close-delimited", "100-continue",
                                  "http/1.0"])
async def test_a_backend_that_closes_at_each_point(client, name):
    """Every prefix of an answer, then the close: whole per h11 -> the same answer; not whole ->
    an UpstreamError (Disconnected before any byte, Broken after); never a leaked connection."""
    raw = FRAMINGS[name]
    for cut in range(len(raw) + 1):
        async with Backend(serve([raw[:cut]])) as backend:
            try:
                expected = h11_answer(raw[:cut])
            except Refused:
                expected = None
            try:
                got = await client_answer(client, backend.url)
            except http1.Disconnected:
                assert cut == 0, (name, cut)
                got = None
            except http1.Broken:
                assert cut > 0, (name, cut)
                got = None
            if expected is None:
                assert got is None, (name, cut, got)
            else:
                assert got == (*expected[:3], False), (name, cut)  # closed: never pooled
            assert client.stats() == (0, 0), (name, cut)


# ---------------------------------------------------------------- a backend that stalls at each point
STALLS = {  # a prefix, then silence: which wait ends it
    "before any byte": (b"", http1.FirstByteTimeout),
    "mid status line": (b"HTTP/1.1 20", http1.FirstByteTimeout),
    "mid head": (b"HTTP/1.1 200 OK\r\nContent-Le", http1.FirstByteTimeout),
    "after the head (a prefill)": (head(b"200 OK", b"Transfer-Encoding: chunked"), http1.FirstByteTimeout),
    "after an interim answer": (head(b"100 Continue"), http1.FirstByteTimeout),
    "mid body": (head(b"200 OK", b"Content-Length: 10") + b"abc", http1.IdleTimeout),
    "mid chunk": (head(b"200 OK", b"Transfer-Encoding: chunked") + b"5\r\nab", http1.IdleTimeout),
    "mid chunk size": (head(b"200 OK", b"Transfer-Encoding: chunked") + b"3\r\nabc\r\n1", http1.IdleTimeout),
    "before the last chunk": (head(b"200 OK", b"Transfer-Encoding: chunked") + b"3\r\nabc\r\n", http1.IdleTimeout),
    "mid trailers": (head(b"200 OK", b"Transfer-Encoding: chunked") + b"3\r\nabc\r\n0\r\nX-T: v",
                     http1.IdleTimeout),
    "close-delimited, mid body": (head(b"200 OK") + b"some", http1.IdleTimeout),
}


async def test_a_backend_that_stalls_at_each_point_meets_a_wait(monkeypatch):
    monkeypatch.setattr(http1, "TICK_S", 0.05)
    client = http1.Client(connect_timeout_s=2, first_byte_timeout_s=0.4, idle_timeout_s=0.4)
    stop = asyncio.Event()

    def stalling(prefix: bytes):
        async def answer(request, writer):
            writer.write(prefix)
            await writer.drain()
            await stop.wait()
            return "close"
        return answer

    async def one(prefix: bytes) -> type[BaseException] | None:
        async with Backend(stalling(prefix)) as backend:
            try:
                await asyncio.wait_for(client_answer(client, backend.url), 5)
            except http1.UpstreamTimeout as exc:
                return type(exc)
        return None

    try:
        results = await asyncio.gather(*(one(prefix) for prefix, _ in STALLS.values()))
        assert dict(zip(STALLS, results, strict=True)) == {point: error for point, (_, error) in STALLS.items()}
        assert client.stats() == (0, 0)
    finally:
        stop.set()
        await client.close()


# ---------------------------------------------------------------- garbage
GARBAGE = {
    "not http": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "binary": bytes(range(256)),
    "http/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "bad version": b"HTTP/1.x 200 OK\r\nContent-Length: 0\r\n\r\n",
    "bad status": b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
    "four-digit status": b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
    "negative length": head(b"200 OK", b"Content-Length: -1") + b"x",
    "non-numeric length": head(b"200 OK", b"Content-Length: 1x") + b"x",
    "two lengths": head(b"200 OK", b"Content-Length: 2", b"Content-Length: 3") + b"abc",
    "length and chunked": head(b"200 OK", b"Content-Length: 3", b"Transfer-Encoding: chunked") + b"0\r\n\r\n",
    "bad chunk size": head(b"200 OK", b"Transfer-Encoding: chunked") + b"zz\r\nab\r\n0\r\n\r\n",
    "chunk longer than said": head(b"200 OK", b"Transfer-Encoding: chunked") + b"2\r\nabcdef\r\n0\r\n\r\n",
    "header without colon": head(b"200 OK", b"Broken header", b"Content-Length: 0"),
    "space before colon": head(b"200 OK", b"X-A : 1", b"Content-Length: 0"),
    "nul in a value": head(b"200 OK", b"X-A: a\x00b", b"Content-Length: 0"),
    "cr in a value": head(b"200 OK", b"X-A: a\rb", b"Content-Length: 0"),
    "obsolete line folding": head(b"200 OK", b"X-A: a", b" folded", b"Content-Length: 0"),
    "switching protocols": head(b"101 Switching Protocols", b"Upgrade: websocket", b"Connection: upgrade"),
}
# Where the client's parser (llhttp, strict) and h11 part ways, what each does and why it is
# acceptable: both refuse, or the client refuses what h11 takes.
LLHTTP_REFUSES_MORE = {
    # RFC 9112 6.3: Transfer-Encoding overrides Content-Length, "ought to be handled as an error"
    # (smuggling); h11 takes the chunked body, llhttp refuses the answer: the safer side for a proxy.
    "length and chunked",
    # RFC 9112 5.2: obs-fold is deprecated; h11 unfolds it, llhttp (strict) refuses it. No engine
    # the console runs folds its headers.
    "obsolete line folding",
}


@pytest.mark.parametrize("name", list(GARBAGE))
async def test_garbage_is_a_clean_error_where_h11_refuses_it(client, name):
    raw = GARBAGE[name]
    try:
        h11_answer(raw)
        h11_takes = True
    except Refused:
        h11_takes = False
    async with Backend(serve([raw])) as backend:
        with pytest.raises(http1.UpstreamError):
            await client_answer(client, backend.url)
        assert client.stats() == (0, 0)
    assert not h11_takes or name in LLHTTP_REFUSES_MORE, f"h11 takes {name!r}; the client refuses it"


# ---------------------------------------------------------------- generated answers
TOKEN = st.text("abcdefghijklmnopqrstuvwxyz0123456789-!#$%&'*+.^_`|~", min_size=1, max_size=12)
VALUE = st.text("".join(chr(c) for c in range(0x21, 0x7f)) + " \t", max_size=40).map(str.strip)
FRAMED = ("content-length", "chunked", "close", "http/1.0", "204", "304")


@st.composite
def answers(draw) -> bytes:
    """A valid answer: status, fields (none that frame or hop), a framing, a body, maybe 1xx first."""
    framing = draw(st.sampled_from(FRAMED))
    status = {"204": 204, "304": 304}.get(framing) or draw(st.integers(200, 599).filter(lambda s: s not in (204, 304)))
    names = draw(st.lists(TOKEN.filter(lambda n: n not in ("content-length", "transfer-encoding", "connection",
                                                            "keep-alive", "trailer", "upgrade")), max_size=8))
    fields = [f"{name}: {draw(VALUE)}".encode() for name in names]
    body = b"" if framing in ("204", "304") else draw(st.binary(max_size=3000))
    interim = b"".join(head(b"%d Info" % s) for s in draw(st.lists(st.sampled_from([100, 102, 103]), max_size=2)))
    version = b"HTTP/1.0" if framing == "http/1.0" else b"HTTP/1.1"
    if framing == "chunked":
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if b > a]
        ext = draw(st.sampled_from([b"", b";x", b";x=1;y=\"q z\""]))
        trailers = b"".join(f"{n}: {draw(VALUE)}\r\n".encode() for n in draw(st.lists(TOKEN, max_size=3)))
        payload = b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in pieces) + b"0\r\n" + trailers + b"\r\n"
        return interim + head(b"%d X" % status, *fields, b"Transfer-Encoding: chunked", version=version) + payload
    if framing in ("content-length", "http/1.0") or draw(st.booleans()) and framing != "close":
        return interim + head(b"%d X" % status, *fields, b"Content-Length: %d" % len(body), version=version) + body
    return interim + head(b"%d X" % status, *fields, version=version) + body


def run(coro):
    return asyncio.run(coro)


async def _through_client(raw: bytes, then: bytes | None) -> tuple[tuple, tuple | None]:
    client = http1.Client(connect_timeout_s=2)
    try:
        async with Backend(serve([raw] if then is None else [raw, then])) as backend:
            first = await client_answer(client, backend.url)
            second = await client_answer(client, backend.url) if then is not None and first[3] else None
            return first, second
    finally:
        await client.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=answers())
def test_generated_answers_read_as_h11_reads_them(raw):
    expected = h11_answer(raw)
    first, second = run(_through_client(raw, NEXT))
    assert first == expected
    if expected[3]:
        assert second is not None and second[:3] == (200, [(b"content-type", b"application/json; charset=utf-8"),
                                                           (b"content-length", b"11")], b'{"ok":true}')


async def _verdict(raw: bytes):
    client = http1.Client(connect_timeout_s=2)
    try:
        async with Backend(serve([raw])) as backend:
            try:
                return await client_answer(client, backend.url)
            except http1.UpstreamError as exc:
                return exc
            finally:
                assert client.stats() == (0, 0)
    finally:
        await client.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=answers(), data=st.data())
def test_broken_answers_are_clean_errors_and_whole_ones_read_as_h11_reads_them(raw, data):
    """A valid answer with one byte changed, inserted or the rest cut off (the backend closes
    after it): the client reads what h11 reads, or raises UpstreamError; never another error, a
    hang or a leaked connection. Where they part ways:
    - the client refuses what h11 takes: llhttp is stricter (a bare LF for CRLF, control bytes
      h11 lets through): a 502, never a misread answer;
    - the client takes what h11 refuses: only bytes in a status line's reason phrase, which the
      client never reads (nor forwards): with the reasons set aside both read the same answer."""
    where = data.draw(st.integers(0, max(len(raw) - 1, 0)))
    how = data.draw(st.sampled_from(["replace", "insert", "cut"]))
    byte = bytes([data.draw(st.integers(0, 255))])
    mutated = {"replace": raw[:where] + byte + raw[where + 1:], "insert": raw[:where] + byte + raw[where:],
               "cut": raw[:where]}[how]
    try:
        expected = h11_answer(mutated)
    except Refused:
        expected = None
    got = run(_verdict(mutated))
    if isinstance(got, http1.UpstreamError):
        return  # refused cleanly (h11 refuses it too, or llhttp is the stricter)
    if expected is None:
        plain = REASON_RE.sub(rb"\1X", mutated)
        assert plain != mutated, f"h11 refuses {mutated!r}; the client read {got}"
        expected = h11_answer(plain)  # Refused here: the difference was not in a reason phrase
    assert got == (*expected[:3], False)


REASON_RE = re.compile(rb"(?m)^(HTTP/1\.[01] [0-9]{3} )[^\r\n]*")


@pytest.mark.parametrize("coding", [b"gzip", b"gzip, chunked", b"hunked", b"identity"])
async def test_a_transfer_coding_the_client_cannot_undo_is_refused(client, coding):
    """Only chunked is undone; any other coding would reach the caller still encoded (llhttp
    reads such a body to the close, as RFC 9112 6.3 says; h11 refuses it, and so does the client)."""
    raw = head(b"200 OK", b"Transfer-Encoding: " + coding) + b"encoded bytes"
    with pytest.raises(Refused):
        h11_answer(raw)
    async with Backend(serve([raw])) as backend:
        with pytest.raises(http1.Broken, match="transfer coding"):
            await client_answer(client, backend.url)
        assert client.stats() == (0, 0)
