"""Tier 1, the hot path: the inference proxy (ASGI app, upstream client, replicas, metrics)."""
