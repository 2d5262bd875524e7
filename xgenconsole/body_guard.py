"""Request bodies are bounded before a byte of them is read, on every route and every server.

Django's ASGI handler reads (and spools to disk) a whole body before any middleware runs, and
daphne buffers it before the application is even called: without this guard an anonymous client
could make the console read any number of bytes, or hold connections open by trickling them.

- `body_limit()` is the rule: the route's limit for a request that carries credentials, a small
  one (the login form) for a request that does not.
- `guard_django()` wraps Django's ASGI app: the declared length is checked first, a large body is
  read only once its credentials check out, and it must arrive within XGEN_BODY_TIMEOUT.
- `GuardedHTTPFactory` does the same inside daphne, where the body is buffered before the app
  runs: there the credentials can only be seen, not checked (uvicorn, the default, checks them).
"""
from __future__ import annotations

import json

from django.conf import settings

from accounts.credentials import authenticate
from accounts.errors import ErrorAnswer, error_body
from serving.proxy.app import PROXY_PREFIXES
from serving.proxy.bodies import read_body


def _has_credentials(headers: dict[bytes, bytes]) -> bool:
    if b"authorization" in headers or b"x-api-key" in headers:
        return True
    cookie = headers.get(b"cookie", b"")
    return (settings.SESSION_COOKIE_NAME.encode() + b"=") in cookie


def body_limit(path: str, headers: dict[bytes, bytes], *, authenticated: bool | None = None) -> int:
    """The largest body this request may send. `authenticated` None = judge by the headers alone."""
    limit = settings.PROXY_MAX_BODY_BYTES if path.startswith(PROXY_PREFIXES) else settings.MAX_REQUEST_BODY_BYTES
    trusted = _has_credentials(headers) if authenticated is None else authenticated
    return limit if trusted else min(limit, settings.ANONYMOUS_MAX_BODY_BYTES)


def _declared_length(headers: dict[bytes, bytes]) -> int | None:
    raw = headers.get(b"content-length")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


async def _send_error(send, exc: ErrorAnswer) -> None:
    body = exc.body()
    await send({"type": "http.response.start", "status": exc.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *exc.headers]})
    await send({"type": "http.response.body", "body": body})


def guard_django(app):
    """ASGI middleware for Django's routes: refuse an oversized, anonymous-and-large or slow body
    before Django reads it; hand Django the body already read, then the live `receive`."""

    async def guarded(scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await app(scope, receive, send)
        headers = dict(scope["headers"])
        anonymous_limit = body_limit(scope["path"], headers, authenticated=False)
        declared = _declared_length(headers)
        authenticated = False
        if declared is None or declared > anonymous_limit:
            try:  # cached for keys and sessions: a database read at most once per cache lifetime
                await authenticate(headers, method="GET", scope=None)  # CSRF and scopes stay Django's to check
                authenticated = True
            except ErrorAnswer:
                pass
        limit = body_limit(scope["path"], headers, authenticated=authenticated)
        try:
            body = await read_body(receive, headers, limit=limit, timeout_s=settings.BODY_TIMEOUT_S)
        except ErrorAnswer as exc:
            return await _send_error(send, exc)
        if body is None:
            return None  # the client left
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await app(scope, replay, send)

    return guarded


# ---------------------------------------------------------------- daphne
def install_daphne_guard() -> None:
    """Make daphne's server build guarded requests (daphne constructs its factory by name)."""
    import daphne.server
    from daphne.http_protocol import HTTPFactory, WebRequest
    from twisted.internet import reactor

    class GuardedWebRequest(WebRequest):
        """Refuses in `gotLength` (headers read, no body yet) and while the body arrives."""

        _refused = False
        _deadline = None

        def gotLength(self, length):  # noqa: N802 (twisted's name)
            path = self.channel._path.split(b"?", 1)[0].decode("latin-1")
            headers = {k.lower(): v[0] for k, v in self.requestHeaders.getAllRawHeaders()}
            self._limit = body_limit(path, headers)
            self._seen = 0
            super().gotLength(length)
            if length is not None and length > self._limit:
                self._refuse(413, f"The request body exceeds {self._limit} bytes.", "request_too_large")
            elif length != 0:
                self._deadline = reactor.callLater(settings.BODY_TIMEOUT_S, self._timed_out)

        def handleContentChunk(self, data):  # noqa: N802
            if self._refused:
                return
            self._seen += len(data)
            if self._seen > self._limit:
                self._refuse(413, f"The request body exceeds {self._limit} bytes.", "request_too_large")
                return
            super().handleContentChunk(data)

        def requestReceived(self, command, path, version):  # noqa: N802
            self._cancel_deadline()
            if not self._refused:
                super().requestReceived(command, path, version)

        def connectionLost(self, reason):  # noqa: N802
            self._cancel_deadline()
            super().connectionLost(reason)

        def _timed_out(self):
            self._deadline = None
            self._refuse(408, f"The request body did not arrive within {settings.BODY_TIMEOUT_S} s.",
                         "request_timeout")

        def _cancel_deadline(self):
            if self._deadline is not None and self._deadline.active():
                self._deadline.cancel()
            self._deadline = None

        def _refuse(self, status: int, message: str, code: str) -> None:
            self._refused = True
            self._cancel_deadline()
            body = json.dumps(error_body(message, status=status, code=code)).encode()
            reason = {408: b"Request Timeout", 413: b"Content Too Large"}[status]
            transport = self.channel.transport
            transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                            b"connection: close\r\n\r\n%s" % (status, reason, len(body), body))
            transport.loseConnection()

    class GuardedHTTPFactory(HTTPFactory):
        def buildProtocol(self, addr):  # noqa: N802
            protocol = super().buildProtocol(addr)
            if protocol is not None:
                protocol.requestFactory = GuardedWebRequest
            return protocol

    daphne.server.HTTPFactory = GuardedHTTPFactory
