"""Fixtures for the hub: both stores on throwaway roots, a request-counting proxy in front of
the S3 endpoint (moto keeps no request log), and a fake Hugging Face Hub on loopback."""
from __future__ import annotations

import http.client
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import S3Endpoint


@pytest.fixture
def hub_dirs(settings, tmp_path: Path) -> Path:
    """MODELS_DIR and STORE_DIR in the test's tmp dir; no MinIO unless a test sets it."""
    settings.MODELS_DIR = tmp_path / "models"
    settings.STORE_DIR = tmp_path / "store"
    settings.MINIO_ENDPOINT = ""
    return tmp_path


def minio_store_for(endpoint: S3Endpoint | str, *, bucket: str = "xgen-test-models", access: str = "testing-access",
                    secret: str = "testing-secret-key"):
    from hub.store import MinioModelStore

    ep = endpoint.endpoint if isinstance(endpoint, S3Endpoint) else endpoint
    return MinioModelStore(endpoint=ep, access_key=access, secret_key=secret, bucket=bucket, secure=False)


@pytest.fixture(params=["filesystem", "minio"])
def store(request, hub_dirs):
    """Each store implementation in turn; the MinIO one talks to the real S3 endpoint."""
    from hub.store import FilesystemModelStore

    if request.param == "filesystem":
        return FilesystemModelStore(hub_dirs / "store")
    s3 = request.getfixturevalue("s3")
    return minio_store_for(s3)


@dataclass
class CountingProxy:
    """A plain HTTP forwarder that counts requests by (method, path without query)."""

    server: ThreadingHTTPServer
    target: tuple[str, int]
    counts: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    dead: bool = False  # set to make the "store" vanish: every request is dropped unanswered
    put_delay: float = 0.0  # slows uploads so a test can act half-way

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"{host}:{port}"

    def gets(self, path_part: str = "") -> int:
        with self.lock:
            return sum(n for (method, path), n in self.counts.items() if method == "GET" and path_part in path)

    def reset(self) -> None:
        with self.lock:
            self.counts.clear()

    @classmethod
    def start(cls, host: str, port: int) -> CountingProxy:
        """A forwarder to host:port on its own loopback port, serving from a daemon thread."""
        ref: list = []
        server = ThreadingHTTPServer(("127.0.0.1", 0), _proxy_handler(ref))
        server.daemon_threads = True
        proxy = cls(server=server, target=(host, port))
        ref.append(proxy)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return proxy

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _proxy_handler(proxy_ref: list) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _forward(self) -> None:
            proxy: CountingProxy = proxy_ref[0]
            if proxy.dead:
                self.close_connection = True
                return
            if self.command == "PUT" and proxy.put_delay:
                time.sleep(proxy.put_delay)
            with proxy.lock:
                proxy.counts[(self.command, self.path.split("?", 1)[0])] += 1
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            conn = http.client.HTTPConnection(*proxy.target, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Handler


@pytest.fixture
def counting_s3(s3: S3Endpoint) -> Iterator[CountingProxy]:
    """The S3 endpoint behind a counting proxy on its own loopback port."""
    proxy = CountingProxy.start(s3.host, s3.port)
    yield proxy
    proxy.stop()


def make_model_dir(root: Path, files: dict[str, bytes]) -> Path:
    """A local model folder with the given relative paths and contents."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def run_uploads(*, store=None, node: str | None = None) -> list:
    """What the node agent does with upload jobs, in this thread: claim every PENDING one of `node`
    (default: this process's) and run it to its end; returns the final jobs, oldest first."""
    from django.conf import settings

    from hub.jobs import upload as upload_jobs

    done = []
    while (job := upload_jobs.claim_next_upload(node_name=node or settings.NODE_NAME)) is not None:
        done.append(upload_jobs.execute_upload(job.pk, store=store))
    return done
