"""The websockets take the page's exact scheme://host:port as their Origin, or one of
XGEN_CSRF_TRUSTED_ORIGINS, as Django's CSRF check does for HTTP writes (issue 34 #17): a page on
another port of the same host is refused with a viewer's cookie, before any consumer runs."""
from __future__ import annotations

import pytest
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import Client

pytestmark = pytest.mark.django_db(transaction=True)


def _cookie(account) -> bytes:
    client = Client()
    client.force_login(account.user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()


async def _opens(cookie: bytes, origin: bytes | None, *, host: bytes = b"127.0.0.1:8000",
                 path: str = "/ws/instances/", scheme: str = "ws", extra: list | None = None) -> bool:
    from xgenconsole.asgi import websocket_app

    headers = [(b"host", host), (b"cookie", cookie), *(extra or [])]
    if origin is not None:
        headers.append((b"origin", origin))
    comm = WebsocketCommunicator(websocket_app, path, headers=headers)
    comm.scope["scheme"] = scheme
    connected, _ = await comm.connect()
    if connected:
        await comm.disconnect()
    return connected


async def test_the_page_own_origin_opens(viewer):
    from asgiref.sync import sync_to_async

    cookie = await sync_to_async(_cookie)(viewer)
    assert await _opens(cookie, b"http://127.0.0.1:8000")
    assert await _opens(cookie, b"http://localhost", host=b"localhost")
    assert await _opens(cookie, b"https://127.0.0.1:8443", host=b"127.0.0.1:8443", scheme="wss")


@pytest.mark.parametrize("origin", [
    b"http://127.0.0.1:8001",  # another port of the same host: what AllowedHostsOriginValidator let in
    b"http://127.0.0.1",  # the default port is another origin too
    b"https://127.0.0.1:8000",  # another scheme
    b"http://localhost:8000",  # an allowed host name, but not the one the page was served from
    b"http://evil.example:8000",
    b"null",
    b"",
])
async def test_any_other_origin_is_refused(viewer, origin):
    from asgiref.sync import sync_to_async

    cookie = await sync_to_async(_cookie)(viewer)
    assert not await _opens(cookie, origin, path="/ws/instances/1/")
    assert not await _opens(cookie, None)  # no Origin at all


async def test_a_host_outside_allowed_hosts_is_refused_even_as_its_own_origin(viewer):
    from asgiref.sync import sync_to_async

    cookie = await sync_to_async(_cookie)(viewer)
    assert not await _opens(cookie, b"http://evil.example:8000", host=b"evil.example:8000")


async def test_trusted_origins_open(viewer, settings):
    from asgiref.sync import sync_to_async

    settings.CSRF_TRUSTED_ORIGINS = ["https://console.example.com", "https://*.corp.example"]
    cookie = await sync_to_async(_cookie)(viewer)
    assert await _opens(cookie, b"https://console.example.com")
    assert await _opens(cookie, b"https://team.corp.example")
    assert not await _opens(cookie, b"http://team.corp.example")  # the scheme is part of it
    assert not await _opens(cookie, b"https://console.example.com:444")


async def test_behind_a_tls_proxy_the_forwarded_scheme_counts(viewer, settings):
    from asgiref.sync import sync_to_async

    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    cookie = await sync_to_async(_cookie)(viewer)
    forwarded = [(b"x-forwarded-proto", b"https")]
    assert await _opens(cookie, b"https://localhost", host=b"localhost", extra=forwarded)
    assert not await _opens(cookie, b"http://localhost", host=b"localhost", extra=forwarded)
