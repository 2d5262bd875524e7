"""Live updates of download jobs for the Downloads page."""
from __future__ import annotations

from hub.events import DOWNLOADS_GROUP, UPLOADS_GROUP
from live.consumers import LiveConsumer


class DownloadsConsumer(LiveConsumer):
    def groups_for(self) -> list[str]:
        return [DOWNLOADS_GROUP]


class UploadsConsumer(LiveConsumer):
    def groups_for(self) -> list[str]:
        return [UPLOADS_GROUP]
