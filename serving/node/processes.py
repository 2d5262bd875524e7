"""Backend processes on this node: starting one in its own session with its log file, how one
exited, /proc readers (state, command line, process group, listening sockets), and stopping a
whole process group."""
from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from hardware.process_memory import group_pids


@dataclass
class BackendProcess:
    """A backend's process group: one this agent started (`proc`, reaped with waitpid), or one a
    previous agent started and this one adopted (only its parent may waitpid it: polled)."""

    pid: int
    pgid: int
    proc: asyncio.subprocess.Process | None = None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def exited(self) -> bool:
        if self.proc is not None:
            return self.proc.returncode is not None
        return not pid_alive(self.pid)

    async def wait(self) -> int | None:
        """Until the process ends: its exit code (None for an adopted one)."""
        if self.proc is not None:
            return await self.proc.wait()
        while pid_alive(self.pid):
            await asyncio.sleep(0.5)
        return None

    async def stop(self, grace_s: float) -> None:
        """SIGTERM the group, wait `grace_s`, SIGKILL the group, reap."""
        await stop_group(self.pgid, proc=self.proc, pid=self.pid, grace_s=grace_s)

    def kill_rest(self) -> None:
        """SIGKILL whatever is left of the group (after the backend itself died)."""
        kill_group(self.pgid)


async def spawn_backend(argv: Sequence[str], *, env: Mapping[str, str], log_path: Path,
                        previous_log: Path | None = None) -> BackendProcess:
    """Start a backend in its own session (pgid == pid), stdout+stderr straight into `log_path`
    (so the log survives the agent), the command line as its first line. A non-empty log of the
    run before is kept as `previous_log`. Arguments are a list, never a shell line."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if previous_log is not None and log_path.exists() and log_path.stat().st_size:
        log_path.replace(previous_log)
    with open(log_path, "ab") as fh:
        fh.write(f"$ {shlex.join(argv)}\n".encode())
        fh.flush()
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=fh, stderr=asyncio.subprocess.STDOUT,
            env=dict(env), cwd=str(log_path.parent), start_new_session=True,
        )
    return BackendProcess(pid=proc.pid, pgid=proc.pid, proc=proc)  # own session: pgid == pid


def backend_key_file(instance_id: int) -> Path:
    """Where a backend that reads its secret from a file (llama-server) finds it: the instance's
    run folder in the data dir (never the log folder, which pages read)."""
    return Path(settings.DATA_DIR) / "run" / "instances" / str(instance_id) / "api-key"


def write_key_file(path: Path, secret: str) -> None:
    """`secret` into `path`, readable by this user only (folder 0700, file 0600 from its creation)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    path.unlink(missing_ok=True)  # a file left by another user's umask or an older run: made afresh
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit {code})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat after the command name (state, ppid, pgrp, ...), or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def proc_state(pid: int) -> str | None:
    """The /proc state letter of `pid` (Z = zombie), or None when it is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def proc_cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def pid_alive(pid: int) -> bool:
    state = proc_state(pid)
    return state is not None and state != "Z"


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on `port` (any address) in this network namespace."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def listener_is_ours(pgid: int | None, port: int) -> bool:
    """Whether the socket listening on `port` belongs to a process of group `pgid`.

    A health answer alone can come from another process that holds the port (two agents on
    one host racing for it, a backend left over); readiness needs the listener to be ours.
    """
    if pgid is None:
        return False
    inodes = _listening_inodes(port)
    if not inodes:
        return False
    # The group's leader (pid == pgid: the backend itself) first: it holds the listener of every
    # engine we start, and reading its fds costs well under a millisecond where listing the
    # group scans all of /proc (5-15 ms on a busy host, in the health check that ends a load).
    if _holds_socket(pgid, inodes):
        return True
    return any(_holds_socket(pid, inodes) for pid in group_pids(pgid) if pid != pgid)


def _holds_socket(pid: int, inodes: set[str]) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def stop_group(pgid: int | None, *, proc: asyncio.subprocess.Process | None, pid: int | None,
                     grace_s: float) -> None:
    """SIGTERM the process group, wait `grace_s`, SIGKILL the group, reap (`proc` when we started
    it; an adopted `pid` is polled, since only its parent may waitpid it)."""
    if pgid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    if proc is not None:
        try:
            async with asyncio.timeout(grace_s):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            await proc.wait()  # reap: no zombie
    elif pid is not None:
        deadline = time.monotonic() + grace_s
        while pid_alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        while pid_alive(pid):
            await asyncio.sleep(0.05)
    # Children the backend left in its group (workers) go too.
    kill_group(pgid)


def kill_group(pgid: int | None) -> None:
    """SIGKILL what is left of a process group (nothing of a dead backend may linger)."""
    with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
        os.killpg(pgid, signal.SIGKILL)
