"""One request to the inference proxy's ASGI app in this process (no server, no socket)."""
from __future__ import annotations


async def call_proxy(method: str, path: str, key: str, body: bytes = b"") -> tuple[int, bytes]:
    """(status, body) of `method path` with `Authorization: Bearer <key>`."""
    from serving.proxy import app

    scope = {"type": "http", "method": method, "path": path, "query_string": b"", "scheme": "http",
             "headers": [(b"authorization", f"Bearer {key}".encode()), (b"host", b"127.0.0.1"),
                         (b"content-type", b"application/json")]}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app.proxy_app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])
