"""Uploads started from the page: run in a thread of the web process that received them (the
path is on that host), with live progress on the Upload page. The store is the record: an
upload cut short (process stopped) never wrote its manifest, so it shows as incomplete."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from asgiref.sync import async_to_sync
from django.db import close_old_connections

from hub import services
from hub.events import publish_upload
from hub.store import get_store

log = logging.getLogger("xgen.hub.uploads")
KEEP = 50
PUBLISH_EVERY_S = 0.3


@dataclass
class UploadProgress:
    """One upload this process runs or ran."""

    id: str
    prefix: str
    local_path: str
    user: str
    status: str = "UPLOADING"
    bytes_done: int = 0
    bytes_total: int = 0
    error: str = ""
    started_at: float = field(default_factory=time.time)

    @property
    def percent(self) -> int:
        if self.status == "COMPLETED":
            return 100
        return int(100 * self.bytes_done / self.bytes_total) if self.bytes_total else 0


_uploads: dict[str, UploadProgress] = {}
_lock = threading.Lock()


def recent_uploads() -> list[UploadProgress]:
    """This process's uploads, newest first."""
    with _lock:
        return sorted(_uploads.values(), key=lambda u: u.started_at, reverse=True)


def get_upload(upload_id: str) -> UploadProgress | None:
    return _uploads.get(upload_id)


async def _current_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def _server_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop serving this request (daphne/uvicorn), if there is one."""
    try:
        loop = async_to_sync(_current_loop)()
    except RuntimeError:
        return None
    return None if loop.is_closed() else loop


def start_upload(*, local_path: str, format: str, name: str, user: str) -> UploadProgress:
    """Validate now (errors raise before anything starts: `services.check_import_path` decides which
    local paths may be read), then upload in a thread (which checks the path again)."""
    prefix, source = services.validate_upload(local_path=local_path, format=format, name=name)
    upload = UploadProgress(id=uuid.uuid4().hex[:12], prefix=prefix, local_path=str(source.path), user=user)
    with _lock:
        _uploads[upload.id] = upload
        for old in sorted(_uploads.values(), key=lambda u: u.started_at)[:-KEEP]:
            _uploads.pop(old.id, None)
    loop = _server_loop()

    def send() -> None:
        if loop is not None and not loop.is_closed():
            asyncio.run_coroutine_threadsafe(publish_upload(upload), loop)
        else:
            async_to_sync(publish_upload)(upload)

    def run() -> None:
        last = 0.0

        def progress(done: int, total: int) -> None:
            nonlocal last
            upload.bytes_done, upload.bytes_total = done, total
            if time.monotonic() - last >= PUBLISH_EVERY_S:
                last = time.monotonic()
                send()

        try:
            services.upload_local_model(local_path=local_path, format=format, name=name, store=get_store(),
                                        progress=progress)
            upload.status = "COMPLETED"
        except Exception as exc:
            log.warning("upload of %s as %s failed: %s", local_path, prefix, exc)
            upload.status, upload.error = "FAILED", str(exc) or exc.__class__.__name__
        finally:
            close_old_connections()
        send()

    threading.Thread(target=run, name=f"upload-{upload.id}", daemon=True).start()
    return upload
