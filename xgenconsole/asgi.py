"""ASGI entry: the inference proxy ahead of Django, websockets, static files, and lifespan.

The proxy's hot path (`/v1/`, `/api/inference/`) never enters Django's request handler
(measured: that handler and its middleware add 2-2.5 ms and cap a process near 250 req/s).
"""
from __future__ import annotations

import asyncio
import gc
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "xgenconsole.settings")
django_http = get_asgi_application()

# Imported after Django is set up (consumers and the proxy touch models).
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import URLRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from accounts.origins import WebsocketOriginValidator  # noqa: E402
from hardware.routing import websocket_urlpatterns as hardware_ws  # noqa: E402
from hub.routing import websocket_urlpatterns as hub_ws  # noqa: E402
from live.tasks import cancel_and_wait  # noqa: E402
from serving.control.autoscale import run_loop  # noqa: E402
from serving.proxy.app import PROXY_PREFIXES, proxy_app  # noqa: E402
from serving.proxy.upstream import shutdown_proxy  # noqa: E402
from serving.proxy.usage import recorder  # noqa: E402
from serving.routing import websocket_urlpatterns as serving_ws  # noqa: E402
from xgenconsole.body_guard import guard_django  # noqa: E402

# The exact scheme://host:port of the page (or XGEN_CSRF_TRUSTED_ORIGINS), as Django's CSRF check.
websocket_app = WebsocketOriginValidator(AuthMiddlewareStack(URLRouter(hardware_ws + hub_ws + serving_ws)))
http_app = guard_django(ASGIStaticFilesHandler(django_http))


async def application(scope, receive, send):
    kind = scope["type"]
    if kind == "http":
        if scope["path"].startswith(PROXY_PREFIXES):
            await proxy_app(scope, receive, send)
        else:
            await http_app(scope, receive, send)
    elif kind == "websocket":
        await websocket_app(scope, receive, send)
    elif kind == "lifespan":
        autoscaler: asyncio.Task | None = None
        # Neither Django nor channels handle lifespan; the usage writer starts and the proxy's pooled
        # client is closed here.
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                recorder.ensure_started()  # its first act: replay what a killed process left in the usage journal
                # The autoscaler's decision loop: every web process runs it, the lease holder decides.
                autoscaler = asyncio.get_running_loop().create_task(run_loop(), name="autoscaler")
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await cancel_and_wait(autoscaler)
                await shutdown_proxy()
                await send({"type": "lifespan.shutdown.complete"})
                return


# What is alive once everything is imported (~130,000 objects: Django, the apps, the proxy) lives
# as long as the process: it moves to the collector's permanent generation, so full collections
# no longer walk it. Without this, at 64 concurrent requests the objects of requests in flight
# promoted at each collection set off a full one every 1-2 s that took up to 65 ms, the p99.
gc.collect()
gc.freeze()
