"""The base of every JSON body of the console's own API (management, store, downloads, caches,
keys): a field the body does not know is refused, 400 `unknown_field` naming each one
(xgenconsole/api.py), never dropped, so a typo such as `max_concurency` cannot look like a
setting that took. The OpenAI-compatible bodies (serving/inference_api.py) are not built on it:
their extra fields are the engine's to read."""
from __future__ import annotations

from ninja import Schema
from pydantic import ConfigDict

UNKNOWN_FIELD = "extra_forbidden"  # pydantic's error type for a field the model does not declare


class StrictBody(Schema):
    """A request body that refuses unknown fields."""

    model_config = ConfigDict(extra="forbid")
