"""Fault-injection helpers: a store forwarder that can stall or vanish mid-transfer, a real
console with the tiny model's backend allowed, and checks on processes and timelines."""
from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.conftest import S3Endpoint, start_console
from tests.procs import stop_process
from tests.proxy.conftest import ProxyConsole
from tests.serving.conftest import LLAMA_CPP_PYTHON, backend_pids

ENV = {"XGEN_RESTART_BACKOFF": "0", "XGEN_RECONCILE_INTERVAL": "1", "XGEN_STOP_GRACE": "5",
       "XGEN_RESTART_LIMIT": "3"}
CHUNK = 16 * 1024


# ---------------------------------------------------------------- a store that fails on cue
@dataclass
class FaultyStore:
    """An HTTP forwarder in front of the S3 endpoint that streams answers chunk by chunk.

    `hold(path_part, after_bytes)` stalls the first whole-object GET answer (a copy; not a ranged
    read of a GGUF's header) for a matching key after that many
    body bytes (or a matching PUT before it is forwarded) until `release()`; `holding` is set
    while it waits. `dead = True` makes the store vanish: new requests are dropped unanswered and
    answers in flight are cut off.
    """

    server: ThreadingHTTPServer
    target: tuple[str, int]
    dead: bool = False
    hold_part: str = ""
    hold_method: str = "GET"
    hold_after: int = 0
    holding: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    requests: list[tuple[str, str]] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"{host}:{port}"

    def hold(self, path_part: str, *, method: str = "GET", after_bytes: int = 0) -> None:
        self.hold_part, self.hold_method, self.hold_after = path_part, method, after_bytes
        self.holding.clear()
        self.released.clear()

    def release(self) -> None:
        self.hold_part = ""
        self.released.set()

    def _should_hold(self, method: str, path: str, *, ranged: bool = False) -> bool:
        # A ranged GET (a load's plan reading a GGUF's header) is not the copy a test stalls.
        if ranged:
            return False
        if self.hold_part and method == self.hold_method and self.hold_part in path and not self.holding.is_set():
            self.holding.set()
            return True
        return False


def _handler(ref: list) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _drop(self) -> None:
            self.close_connection = True

        def _forward(self) -> None:
            store: FaultyStore = ref[0]
            if store.dead:
                return self._drop()
            path = self.path.split("?", 1)[0]
            store.requests.append((self.command, path))
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            hold = store._should_hold(self.command, path, ranged="Range" in self.headers)
            if hold and self.command != "GET":
                store.released.wait(120)
                if store.dead:
                    return self._drop()
            conn = http.client.HTTPConnection(*store.target, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "HEAD":
                return None
            sent = 0
            for start in range(0, len(data), CHUNK):
                if hold and self.command == "GET" and sent >= store.hold_after:
                    store.released.wait(120)
                    hold = False
                if store.dead:  # cut off mid-answer: the client sees a short body
                    return self._drop()
                self.wfile.write(data[start:start + CHUNK])
                self.wfile.flush()
                sent += len(data[start:start + CHUNK])
            return None

        def _guarded(self) -> None:
            try:
                self._forward()
            except (BrokenPipeError, ConnectionResetError):  # the client was killed mid-answer
                self.close_connection = True

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _guarded

    return Handler


@pytest.fixture
def faulty_store(s3: S3Endpoint) -> Iterator[FaultyStore]:
    """The (emptied) S3 endpoint behind a FaultyStore on its own loopback port."""
    ref: list = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(ref))
    server.daemon_threads = True
    store = FaultyStore(server=server, target=(s3.host, s3.port))
    ref.append(store)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield store
    store.release()
    server.shutdown()
    server.server_close()


def minio_env(store: FaultyStore, s3: S3Endpoint) -> dict[str, str]:
    return {"MINIO_ENDPOINT": store.endpoint, "MINIO_ACCESS_KEY": s3.access_key, "MINIO_SECRET_KEY": s3.secret_key,
            "MINIO_BUCKET": "xgen-faults"}


def put_in_store(s3: S3Endpoint, prefix: str, local: Path) -> None:
    """Upload a model straight to the S3 endpoint (bypassing the forwarder), as an earlier upload would."""
    from hub.store import MinioModelStore

    MinioModelStore(endpoint=s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key,
                    bucket="xgen-faults").upload_model(prefix, local)


# ---------------------------------------------------------------- a console under test
class FaultConsole(ProxyConsole):
    """A real `manage.py serve` (web + agent) with an admin key, and what the test asks of it."""

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", headers=self.auth, json=body, timeout=30)

    def instance(self, instance_id: int) -> dict:
        r = httpx.get(f"{self.url}/api/management/instances/{instance_id}", headers=self.auth, timeout=10)
        r.raise_for_status()
        return r.json()

    def wait_instance(self, instance_id: int, predicate: Callable[[dict], bool], *, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        body: dict = {}
        while time.monotonic() < deadline:
            body = self.instance(instance_id)
            if predicate(body):
                return body
            time.sleep(0.05)
        raise AssertionError(f"instance {instance_id} never got there; last: "
                             f"{ {k: body.get(k) for k in ('state', 'state_message', 'restarts', 'pid', 'error')} }")

    def shell(self, code: str) -> str:
        return self.console.manage("shell", "-v", "0", "-c", code).stdout.strip()

    def events(self, instance_id: int) -> list[dict]:
        """The instance's InstanceEvent timeline, oldest first."""
        code = ("import json; from serving.models import InstanceEvent; print(json.dumps(list("
                f"InstanceEvent.objects.filter(instance_id={instance_id}).order_by('at', 'pk')"
                ".values('from_state', 'to_state', 'message'))))")
        return json.loads(self.shell(code).splitlines()[-1])

    def kill(self) -> None:
        """kill -9 the console (web and agent in one process) and reap it."""
        os.kill(self.console.proc.pid, signal.SIGKILL)
        self.console.proc.wait()

    def stop(self) -> int:
        return stop_process(self.console.proc, timeout=30)


def open_console(data_dir: Path, *, extra_env: dict | None = None, server: str = "uvicorn",
                 key: str | None = None) -> FaultConsole:
    """Start a console on `data_dir`; the node gets llama-cpp-python on the CPU; an admin key."""
    console = start_console(data_dir, extra_env={**ENV, **(extra_env or {})}, server=server)
    try:
        code = ("import json; from hardware.models import Node; print(Node.objects.filter(name='test-node')"
                f".update(backends=json.loads({json.dumps([LLAMA_CPP_PYTHON])!r})))")
        deadline = time.monotonic() + 30
        while console.manage("shell", "-v", "0", "-c", code).stdout.strip() != "1":
            assert time.monotonic() < deadline, "the node never registered"
            time.sleep(0.2)
        if key is None:
            key = console.manage("createapikey", "--username", "admin").stdout.strip()
    except BaseException:
        stop_process(console.proc)
        raise
    return FaultConsole(console=console, key=key)


@pytest.fixture
def consoles() -> Iterator[list[FaultConsole]]:
    """Consoles a test opens (append them); all stopped after it, and any backend they left killed."""
    opened: list[FaultConsole] = []
    yield opened
    for c in opened:
        if c.console.proc.poll() is None:
            c.stop()
    for c in opened:
        for pid in serve_backends(c.console.data_dir):
            os.kill(pid, signal.SIGKILL)


def backends_console(data_dir: Path, *, extra_env: dict | None = None) -> Iterator[FaultConsole]:
    """A module's console with every engine it may start (usage flushed each second, 20 restarts),
    for `yield from` in a module fixture: stopped cleanly at the end, and no backend may outlive it."""
    from tests.serving.conftest import set_console_backends

    c = open_console(data_dir, extra_env={"XGEN_USAGE_FLUSH": "1", "XGEN_RESTART_LIMIT": "20", **(extra_env or {})})
    try:
        set_console_backends(c.console)
        yield c
    finally:
        if c.console.proc.poll() is None:
            assert c.stop() == 0, c.console.log[-3000:]
        left = serve_backends(c.console.data_dir)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert left == [], "backends left running after the console stopped"


def serve_backends(data_dir: Path) -> list[int]:
    """Backend processes started for a console's data dir (their cwd is its log folder), any parent."""
    out = []
    logs = str(data_dir / "logs")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and cwd.startswith(logs):
            out.append(int(entry))
    return out


def assert_timeline_chains(events: list[dict], final_state: str) -> None:
    """Every event starts where the one before ended, and the last one is the row's state."""
    assert events and events[0]["from_state"] == "", events[:1]
    for before, after in zip(events, events[1:], strict=False):
        assert after["from_state"] == before["to_state"], f"timeline breaks: {before} -> {after}"
    assert events[-1]["to_state"] == final_state, events[-3:]


__all__ = ["ENV", "FaultConsole", "FaultyStore", "assert_timeline_chains", "backend_pids", "minio_env",
           "open_console", "put_in_store", "serve_backends"]
