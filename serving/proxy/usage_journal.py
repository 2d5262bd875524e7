"""The usage journal: what a web process counted and has not written yet, on its own disk, so a
process killed with `kill -9` (or an OOM kill, a segfault) loses no request-log row or usage.

Each process appends one line per recorded request to its live segment,
`<dir>/<pid>-<random>-<seq>.jsonl`, with one `os.write` on an `O_APPEND` descriptor (no fsync
unless XGEN_USAGE_JOURNAL_FSYNC: the page cache outlives the process, not a power loss). The
writer (serving.proxy.usage.UsageRecorder) closes the live segment at each write to the database, in
the same critical section that takes the rows from memory, so the rows a write carries are exactly
those of the segments it names; the write's transaction records those names
(serving.UsageJournalSegment) and the files are deleted after the commit.

The owner holds `flock(LOCK_EX)` on `<dir>/<pid>-<random>.lock` for as long as it lives (one
descriptor, however many segments a database outage leaves uncommitted). Anyone who can take that
lock without waiting knows the owner is dead: `orphan_segments` hands its segments, each locked
in turn (replayers never share one), to a replayer (serving.proxy.usage.replay_journal), which writes
their rows unless their name was committed already (a crash between the commit and the delete),
then deletes them, and the lock file once none is left.

This module only handles files; it never touches the database.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("xgen.usage")

SUFFIX = ".jsonl"
LOCK_SUFFIX = ".lock"


class UsageJournal:
    """One process's journal: its lock, its live segment and the closed ones not committed yet.

    Not thread-safe by itself: the recorder calls append(), rotate() and committed() under its own
    lock. Two descriptors at most, however long the database is away (a segment closed at each
    try to write stays a file until its commit, not an open descriptor).
    """

    def __init__(self, directory: Path, *, fsync: bool = False) -> None:
        self.directory = Path(directory)
        self.fsync = fsync
        self.prefix = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._seq = 0
        self._lock_fd: int | None = None  # flock(LOCK_EX) on <prefix>.lock for as long as this process lives
        self._fd: int | None = None
        self._name = ""
        self._pending: list[str] = []  # closed segments awaiting their commit
        self._failing = False  # a write failed: logged once until one succeeds again

    # ---------------------------------------------------------------- the writer's side
    def append(self, line: bytes) -> None:
        """One record (a whole line, newline included). Never raises: usage in memory still goes
        to the database at the next write; only its survival of a crash is lost."""
        fd = self._fd
        try:
            if fd is None:
                fd = self._open()
            os.write(fd, line)  # O_APPEND: one write, one line (a kill cannot interleave another)
            if self.fsync:
                os.fsync(fd)
        except OSError as exc:
            if not self._failing:
                self._failing = True
                log.warning("usage journal: cannot write to %s (%s); usage is counted in memory only until "
                            "it can (a crash meanwhile loses what was not written yet)", self.directory, exc)
            return
        if self._failing:
            self._failing = False
            log.info("usage journal: writing to %s again", self.directory)

    def _open(self) -> int:
        """A new live segment (and, the first time, this process's lock)."""
        if self._lock_fd is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _locked_file(self.directory, f"{self.prefix}{LOCK_SUFFIX}")
        self._seq += 1
        name = f"{self.prefix}-{self._seq:06d}{SUFFIX}"
        self._fd = os.open(self.directory / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                           0o600)
        self._name = name
        return self._fd

    def rotate(self) -> list[str]:
        """Close the live segment (the next append opens a new one); the names of every segment not
        committed yet, whose rows are those the caller takes now."""
        if self._fd is not None:
            os.close(self._fd)
            self._pending.append(self._name)
            self._fd, self._name = None, ""
        return list(self._pending)

    def committed(self, names: list[str]) -> None:
        """The segments `names` are in the database: delete them."""
        done = set(names)
        self._pending = [name for name in self._pending if name not in done]
        for name in names:
            try:
                (self.directory / name).unlink(missing_ok=True)
            except OSError as exc:  # a replayer deletes it later (its name is committed)
                log.warning("usage journal: could not delete %s: %s", name, exc)

    def finish(self) -> None:
        """A clean stop with everything committed: the lock file goes too (a later append starts over)."""
        if self._fd is None and not self._pending and self._lock_fd is not None:
            (self.directory / f"{self.prefix}{LOCK_SUFFIX}").unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None

    def close(self) -> None:
        """Let go of the lock and the live segment without deleting anything, as a crash does (what
        was not committed gets replayed)."""
        for fd in (self._fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._fd, self._name, self._lock_fd = None, "", None
        self._pending = []


def _locked_file(directory: Path, name: str) -> int:
    """`name` created and locked before it has its name: a replayer never sees it unlocked."""
    tmp = directory / f".{name}.{uuid.uuid4().hex[:8]}.new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(tmp, directory / name)
    except OSError:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd


# ---------------------------------------------------------------- the replayer's side
@dataclass
class OrphanSegment:
    """A segment whose owner is gone, locked by the replayer until done() or release()."""

    path: Path
    fd: int
    records: list[list]
    torn: int  # lines that could not be read (a crash mid-write leaves at most the last one)
    mtime: float

    @property
    def name(self) -> str:
        return self.path.name

    def done(self) -> None:
        """Its rows are in the database (or it was refused): delete it."""
        try:
            self.path.unlink(missing_ok=True)
        finally:
            self.release()

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def orphan_segments(directory: Path) -> Iterator[OrphanSegment]:
    """The segments in `directory` whose owner is dead (its lock is free, or gone), oldest first
    per owner, each locked while the caller handles it. A live process's segments (this one's
    included) are skipped. A dead owner's lock file goes once its segments are all done."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    owners: dict[str, list[str]] = {}
    for name in names:
        if name.startswith("."):
            continue
        if name.endswith(SUFFIX):
            owners.setdefault(name.rsplit("-", 1)[0], []).append(name)
        elif name.endswith(LOCK_SUFFIX):
            owners.setdefault(name[:-len(LOCK_SUFFIX)], [])
    for prefix, segments in sorted(owners.items()):
        lock_path = Path(directory) / f"{prefix}{LOCK_SUFFIX}"
        lock_fd = _try_lock(lock_path)
        if lock_fd == -1:  # its owner lives (or another replayer has it)
            continue
        try:
            left = 0
            for name in sorted(segments):
                path = Path(directory) / name
                fd = _try_lock(path)
                if fd is None:  # committed and deleted meanwhile
                    continue
                if fd == -1:  # another replayer has it (its owner's lock file was gone)
                    left += 1
                    continue
                stat = os.fstat(fd)
                if stat.st_nlink == 0:  # deleted between our open and our lock
                    os.close(fd)
                    continue
                with os.fdopen(os.dup(fd), "rb") as f:
                    data = f.read()
                records, torn = parse(data, name)
                segment = OrphanSegment(path=path, fd=fd, records=records, torn=torn, mtime=stat.st_mtime)
                try:
                    yield segment
                finally:
                    segment.release()
                left += path.exists()
            if lock_fd is not None and not left:
                lock_path.unlink(missing_ok=True)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)


def _try_lock(path: Path) -> int | None:
    """`path` opened and locked without waiting: its descriptor, -1 when someone holds it, None
    when there is no such file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return -1
    except OSError:
        os.close(fd)
        raise
    return fd


def parse(data: bytes, name: str = "") -> tuple[list[list], int]:
    """The records of a segment's bytes, and how many lines were unreadable (skipped, warned)."""
    records: list[list] = []
    torn = 0
    lines = data.split(b"\n")
    last = lines.pop()  # b"" when the file ends with a newline, else a line cut by a crash mid-write
    if last:
        torn += 1
        log.warning("usage journal %s: its last line is incomplete (%d bytes, a crash mid-write): skipped",
                    name, len(last))
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, list):
                raise ValueError("not a list")
        except ValueError as exc:
            torn += 1
            log.warning("usage journal %s: line %d unreadable (%s): skipped", name, number, exc)
            continue
        records.append(record)
    return records, torn


def stale(segment: OrphanSegment, max_age_s: float) -> bool:
    """Older than the committed names are kept: replaying it could count it twice."""
    return time.time() - segment.mtime > max_age_s
