"""The proxy's own answers, in the OpenAI error shape."""
from __future__ import annotations

import json

from xgenconsole.errors import error_body


class ProxyError(Exception):
    """An answer the proxy gives itself, in the OpenAI error shape."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or []

    def body(self) -> bytes:
        return json.dumps(error_body(self.message, status=self.status, code=self.code)).encode()
