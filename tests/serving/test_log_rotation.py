"""A backend's log stays under XGEN_BACKEND_LOG_MAX_MB while the backend writes on (issue 17, "also
look at": logs were never rotated), and a line without end is cut, never held without limit."""
from __future__ import annotations

import asyncio
import subprocess
import sys

from serving.node.logs import MAX_PARTIAL, LogTailer

WRITER = """
import sys, time
with open(sys.argv[1], "ab", buffering=0) as fh:  # what a backend does: O_APPEND, its own fd
    for i in range(int(sys.argv[2])):
        fh.write(b"line %06d " % i + b"x" * 90 + b"\\n")
        if i % 200 == 0:
            time.sleep(0.01)
    fh.write(b"last line\\n")
"""


async def test_a_log_is_cut_back_while_the_backend_writes_on(tmp_path, settings):
    settings.BACKEND_LOG_MAX_BYTES = 64 * 1024
    path = tmp_path / "current.log"
    path.touch()
    seen: list[str] = []

    async def on_lines(lines, offset):
        seen.extend(lines)

    tailer = LogTailer(path, on_lines=on_lines)
    tailer.start(from_start=True)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "6000"])  # ~600 KB in all
    try:
        while writer.poll() is None:
            await asyncio.sleep(0.05)
        for _ in range(100):
            if "last line" in seen:
                break
            await asyncio.sleep(0.05)
    finally:
        await tailer.stop()
    assert writer.returncode == 0
    assert "last line" in seen and tailer.tail[-1] == "last line"
    text = path.read_text()
    assert "[xgen: log rotated at" in text
    assert path.stat().st_size < settings.BACKEND_LOG_MAX_BYTES + 64 * 1024  # bounded, not 600 KB
    assert text.rstrip().endswith("last line")


async def test_a_line_without_end_is_cut(tmp_path, settings):
    path = tmp_path / "current.log"
    path.write_bytes(b"y" * (MAX_PARTIAL * 3))
    seen: list[str] = []

    async def on_lines(lines, offset):
        seen.extend(lines)

    tailer = LogTailer(path, on_lines=on_lines)
    tailer.start(from_start=True)
    for _ in range(100):
        if seen:
            break
        await asyncio.sleep(0.05)
    await tailer.stop()
    assert seen and all(len(line) <= 2000 for line in seen)
