"""Live updates of the hub's jobs: the Downloads and Upload pages, and a node's cache card."""
from __future__ import annotations

from hub.events import DOWNLOADS_GROUP, UPLOADS_GROUP, node_cache_group
from live.consumers import LiveConsumer


class DownloadsConsumer(LiveConsumer):
    def groups_for(self) -> list[str]:
        return [DOWNLOADS_GROUP]


class UploadsConsumer(LiveConsumer):
    def groups_for(self) -> list[str]:
        return [UPLOADS_GROUP]


class NodeCacheConsumer(LiveConsumer):
    """/ws/nodes/<name>/cache/: the rows of that node's cache jobs (evict, verify)."""

    def groups_for(self) -> list[str]:
        return [node_cache_group(self.scope["url_route"]["kwargs"]["name"])]
