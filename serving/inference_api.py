"""The inference operations in the OpenAPI docs (the proxy core serves the hot path)."""
from ninja import Router

router = Router()
