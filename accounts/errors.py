"""One error shape for every JSON answer: OpenAI's {"error": {message, type, code}}.

Here, on the floor, because every app answers in it and the header check in accounts raises it.
`ApiError` is for Django and Ninja views; `ErrorAnswer` for code that answers outside Django's
handler (the proxy, the body guard), which sends `body()` itself.
"""
from __future__ import annotations

import json
from typing import Any

from django.http import JsonResponse
from ninja.errors import HttpError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_error",
}


def error_type_for(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, *, status: int, code: str | None = None, type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or error_type_for(status), "code": code}}


def json_error(status: int, message: str, *, code: str | None = None, type: str | None = None) -> JsonResponse:
    return JsonResponse(error_body(message, status=status, code=code, type=type), status=status)


class ApiError(HttpError):
    """An HttpError that also carries the OpenAI `code` (and optionally `type`)."""

    def __init__(self, status_code: int, message: str, *, code: str | None = None, type: str | None = None):
        super().__init__(status_code, message)
        self.code = code
        self.type = type


class ErrorAnswer(Exception):
    """An error answered in this shape by a raw ASGI app: status, message, code, and the extra
    response headers it needs (WWW-Authenticate, Allow)."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or []

    def body(self) -> bytes:
        return json.dumps(error_body(self.message, status=self.status, code=self.code)).encode()
