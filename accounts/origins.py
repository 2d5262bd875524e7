"""Whose page may act with a browser's session: the exact `scheme://host:port` it was served from,
or one of XGEN_CSRF_TRUSTED_ORIGINS, as Django's CSRF check decides for HTTP writes.

Channels' AllowedHostsOriginValidator compared the Origin's host name alone, so a page on another
port of the same host (any local web app) could open `/ws/instances/N/` with a viewer's cookie.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import split_domain_port, validate_host
from django.utils.http import is_same_domain

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _trusted(origin: str) -> bool:
    """In CSRF_TRUSTED_ORIGINS: exactly, or under a `scheme://*.domain` entry (Django's two forms)."""
    trusted = settings.CSRF_TRUSTED_ORIGINS
    if origin in trusted:
        return True
    parts = urlsplit(origin)
    for entry in trusted:
        if "*" in entry:
            pattern = urlsplit(entry)
            if pattern.scheme == parts.scheme and parts.netloc and is_same_domain(parts.netloc,
                                                                                   pattern.netloc.lstrip("*")):
                return True
    return False


def origin_allowed(origin: str, *, scheme: str, host: str) -> bool:
    """True when `origin` is this request's own `scheme://host[:port]` (Host header as sent; its
    name in ALLOWED_HOSTS) or a trusted origin. `scheme` is http or https."""
    name, _ = split_domain_port(host)
    if host and name and validate_host(name, settings.ALLOWED_HOSTS) and origin == f"{scheme}://{host}":
        return True
    return _trusted(origin)


def _secure(scope: Scope, headers: dict[bytes, bytes]) -> bool:
    """wss, or (behind a TLS proxy) SECURE_PROXY_SSL_HEADER as Django's request.is_secure() reads it."""
    if scope.get("scheme") in ("wss", "https"):
        return True
    proxy_header = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
    if proxy_header:
        name, value = proxy_header
        sent = headers.get(name.removeprefix("HTTP_").replace("_", "-").lower().encode(), b"")
        return sent.decode("latin-1").split(",")[0].strip() == value
    return False


class WebsocketOriginValidator:
    """ASGI middleware for websockets: a handshake without an Origin, or from any other origin than
    the page's own (or a trusted one), is refused before the consumer runs."""

    def __init__(self, application: ASGIApp) -> None:
        self.application = application

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers") or [])
        origin = headers.get(b"origin", b"").decode("latin-1")
        host = headers.get(b"host", b"").decode("latin-1")
        scheme = "https" if _secure(scope, headers) else "http"
        if origin and origin_allowed(origin, scheme=scheme, host=host):
            return await self.application(scope, receive, send)
        return await WebsocketDenier()(scope, receive, send)
