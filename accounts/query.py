"""What a client types into a query string, read one way everywhere: whole numbers in ASCII digits.

`str.isdigit()` passes '²' and '١', which `int()` then refuses (a 500); this parser answers 400 with
a message instead, on pages (Django's BadRequest, shown by handler400) and in the API (ApiError).
"""
from __future__ import annotations

import re
from collections.abc import Mapping

from django.core.exceptions import BadRequest

from accounts.errors import ApiError

ASCII_INT_RE = re.compile(r"[0-9]{1,18}")  # 18 digits: every value fits a 64-bit column


class InvalidQueryParam(ApiError, BadRequest):
    """A query parameter that is not what its route takes: 400 on pages and in the API."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message, code="invalid_request")


def ascii_int(text: str) -> int | None:
    """`text` as a whole number when it is ASCII digits only (at most 18), else None."""
    return int(text) if ASCII_INT_RE.fullmatch(text) else None


def query_int(params: Mapping[str, str], name: str, *, minimum: int = 0, maximum: int = 10**18 - 1) -> int | None:
    """The whole number in query parameter `name` (None when absent or empty); InvalidQueryParam
    (400) for anything else, or a number outside [minimum, maximum]."""
    raw = (params.get(name) or "").strip()
    if raw == "":
        return None
    value = ascii_int(raw)
    if value is None or not minimum <= value <= maximum:
        raise InvalidQueryParam(f"`{name}` must be a whole number from {minimum} to {maximum} (ASCII digits), "
                                f"not {raw[:40]!r}.")
    return value
