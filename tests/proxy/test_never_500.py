"""Odd requests get a 4xx in the OpenAI shape from the proxy, never a 500 or a dropped connection."""
from __future__ import annotations

import socket

import pytest


def _raw(console, request: bytes) -> tuple[int, bytes]:
    host, port = console.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


ODD = [
    (b"GET", b"/v1/models", {b"Authorization": b"Bearer \xff\xfe"}),
    (b"GET", b"/v1/models", {b"Authorization": b"bearer"}),
    (b"GET", b"/v1/models", {b"Cookie": b"sessionid=\"unterminated; csrftoken=;;;="}),
    (b"GET", b"/v1/models", {b"Cookie": b"sessionid=" + b"a" * 5000}),
    (b"POST", b"/v1/chat/completions", {b"Cookie": b"sessionid=x", b"X-CSRFToken": b"\xff" * 64}),
    (b"GET", b"/v1/models/" + b"%00" * 10, {}),
    (b"GET", b"/api/inference/", {}),
    (b"GET", b"/metrics?x=1", {b"Authorization": b"Bearer nope"}),
    (b"PATCH", b"/v1/models", {}),
]


@pytest.mark.parametrize(("method", "path", "headers"), ODD)
def test_odd_requests_are_answered_in_openai_shape(proxy_console, method, path, headers):
    import json

    lines = [method + b" " + path + b" HTTP/1.1", b"Host: 127.0.0.1", b"Content-Length: 0", b"Connection: close"]
    lines += [k + b": " + v for k, v in headers.items()]
    status, body = _raw(proxy_console, b"\r\n".join(lines) + b"\r\n\r\n")
    assert 400 <= status < 500, (status, body)
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "code"}


@pytest.mark.parametrize("body", [b'{"model": "x", "messages": [' * 2000, b'{"model": ' + b'"' * 3 + b"}",
                                  b'{"model": null, "messages": []}', b'{"model": {"a": 1}}', b"\x00" * 100])
def test_odd_bodies_are_answered_in_openai_shape(proxy_console, body):
    import json

    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Authorization: Bearer " + proxy_console.key.encode() + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n")
    status, answer = _raw(proxy_console, head + body)
    assert 400 <= status < 600 and status != 500, (status, answer)
    assert set(json.loads(answer)["error"]) == {"message", "type", "code"}
