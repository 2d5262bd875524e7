"""Backend logs: where they live (one folder per instance, the current run and the one before,
kept after a crash or a restart), and the LogTailer that follows a running backend's log. The
web side reads the files; the supervisor writes them (the backend itself, in fact) and tails them."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from django.conf import settings

from live.tasks import cancel_and_wait

log = logging.getLogger("xgen.supervisor")

TAIL_LINES = 50
TAIL_FLUSH_S = 0.5
TAIL_POLL_S = 0.1
MAX_LINE = 2000
MAX_PARTIAL = 64 * 1024  # a "line" longer than this without a newline is cut (never held without limit)
ROTATE_KEEP = 256 * 1024  # what a rotated log keeps of its end (at most a quarter of the limit)


def instance_log_dir(instance_id: int) -> Path:
    return Path(settings.LOG_DIR) / "instances" / str(instance_id)


def current_log(instance_id: int) -> Path:
    return instance_log_dir(instance_id) / "current.log"


def previous_log(instance_id: int) -> Path:
    return instance_log_dir(instance_id) / "previous.log"


class LogTailer:
    """Follows one log file while its backend runs.

    Keeps the last TAIL_LINES lines, sets `ready_hint` when a line holds one of `hints` (it only
    makes the health poll come sooner), hands every batch of new lines to `on_lines` (the live
    page, with the file offset after them) and the tail to `on_flush` (the database) at most every
    TAIL_FLUSH_S, and once more when stopped.
    """

    def __init__(self, path: Path, *, hints: Sequence[str] = (),
                 on_lines: Callable[[list[str], int], Awaitable[None]] | None = None,
                 on_flush: Callable[[list[str]], Awaitable[None]] | None = None) -> None:
        self.path = path
        self.hints = tuple(hints)
        self.on_lines = on_lines
        self.on_flush = on_flush
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.ready_hint = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self, *, from_start: bool) -> None:
        """Follow the file: from its first byte (a new run), or from its end with the last lines
        as the tail (a backend adopted after an agent restart)."""
        self._task = asyncio.create_task(self._follow(from_start=from_start), name=f"tail-{self.path}")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)  # cancelled again if it lost the cancel (live.tasks)
            self._task = None

    def last_lines(self, n: int = 12) -> str:
        return "\n".join(list(self.tail)[-n:])

    def _rotate(self, fh, size: int) -> None:
        """Keep a log under XGEN_BACKEND_LOG_MAX_MB: its last ROTATE_KEEP bytes stay, behind a line
        that says how much went. The backend appends (O_APPEND), so it writes on at the new end."""
        fh.seek(max(0, size - min(ROTATE_KEEP, settings.BACKEND_LOG_MAX_BYTES // 4)))
        kept = fh.read()
        os.truncate(self.path, 0)
        marker = f"[xgen: log rotated at {size} bytes; the first {size - len(kept)} bytes were dropped]\n"
        with open(self.path, "ab") as out:
            out.write(marker.encode() + kept)
        fh.seek(len(marker.encode()) + len(kept))  # all of that was read already

    async def _follow(self, *, from_start: bool) -> None:
        last_flush, dirty = 0.0, False
        try:
            with open(self.path, "rb") as fh:
                if not from_start:
                    fh.seek(max(0, self.path.stat().st_size - 16384))
                    for line in fh.read().decode(errors="replace").splitlines()[-TAIL_LINES:]:
                        self.tail.append(line[:MAX_LINE])
                partial = b""
                limit = settings.BACKEND_LOG_MAX_BYTES
                while True:
                    chunk = fh.read(65536)
                    if chunk:
                        *lines, partial = (partial + chunk).split(b"\n")
                        if len(partial) > MAX_PARTIAL:
                            lines.append(partial)
                            partial = b""
                        texts = [ln.decode(errors="replace").rstrip("\r")[:MAX_LINE] for ln in lines]
                        for text in texts:
                            self.tail.append(text)
                            if any(h in text for h in self.hints):
                                self.ready_hint.set()
                        if texts:
                            dirty = True
                            if self.on_lines is not None:
                                await self.on_lines(texts, fh.tell() - len(partial))
                    if dirty and self.on_flush is not None and time.monotonic() - last_flush >= TAIL_FLUSH_S:
                        try:
                            await self.on_flush(list(self.tail))
                        except Exception:  # a database hiccup must not end the tail; the next flush retries
                            log.warning("saving the log tail of %s failed", self.path, exc_info=True)
                        last_flush, dirty = time.monotonic(), False
                    if not chunk:
                        if fh.tell() >= limit:
                            self._rotate(fh, fh.tell())
                        await asyncio.sleep(TAIL_POLL_S)
        except asyncio.CancelledError:
            if dirty and self.on_flush is not None:
                with contextlib.suppress(Exception):
                    await self.on_flush(list(self.tail))
            raise
        except OSError:
            log.warning("cannot follow %s", self.path, exc_info=True)
