"""The proxy's own answers, in the OpenAI error shape."""
from __future__ import annotations

from accounts.errors import ErrorAnswer


class ProxyError(ErrorAnswer):
    """An answer the proxy gives itself (a refused credential is accounts' ErrorAnswer)."""
