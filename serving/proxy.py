"""Inference proxy (placeholder until the proxy lands): answers 503 no_backend."""
from __future__ import annotations

import json

PROXY_PREFIXES = ("/v1/", "/api/inference/")


async def proxy_app(scope, receive, send) -> None:
    body = json.dumps({"error": {"message": "No backend is ready.", "type": "service_unavailable", "code": "no_backend"}}).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


async def shutdown_proxy() -> None:
    return None
