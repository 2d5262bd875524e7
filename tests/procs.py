"""Child-process bookkeeping for tests: what the test run left running or defunct."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# Children that live for the whole session on purpose (pids).
SESSION_CHILDREN: set[int] = set()


def _stat(pid: int) -> tuple[int, str] | None:
    """(ppid, state) of a process, or None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    rest = raw[raw.rfind(")") + 2 :].split()
    return int(rest[1]), rest[0]


def children_of(parent: int) -> list[tuple[int, str]]:
    """Direct children of `parent` as (pid, state); state 'Z' is a zombie."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st and st[0] == parent:
                out.append((int(entry), st[1]))
    return out


def leftover_children() -> list[str]:
    left = []
    for pid, state in children_of(os.getpid()):
        if pid in SESSION_CHILDREN:
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "?"
        left.append(f"pid {pid} state {state}: {cmd[:200]}")
    return left


def pid_alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] != "Z"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_http(url: str, *, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers below 500; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code < 500:
                return
            last = r.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer in {timeout}s (last: {last})")


def stop_process(proc: subprocess.Popen, *, timeout: float = 10) -> int:
    """SIGTERM, wait, SIGKILL; always reaps."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


PYTHON = sys.executable
