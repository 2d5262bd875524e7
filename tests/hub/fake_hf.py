"""A tiny Hugging Face Hub on loopback: the endpoints snapshot_download uses (see recipes.md)."""
from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

REVISION_RE = re.compile(r"^/api/models/(.+?)/revision/([^/]+)$")
TREE_RE = re.compile(r"^/api/models/(.+?)/tree/([^/]+)/?$")
RESOLVE_RE = re.compile(r"^/(.+?)/resolve/([^/]+)/(.+)$")


@dataclass
class FakeHub:
    """repos: repo_id -> {path: bytes}. `delay_per_chunk` slows GETs so progress is visible."""

    repos: dict[str, dict[str, bytes]]
    delay_per_chunk: float = 0.0
    chunk: int = 64 * 1024
    server: ThreadingHTTPServer | None = None
    requests: list[tuple[str, str]] = field(default_factory=list)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def sha(self, repo_id: str) -> str:
        return hashlib.sha1(repo_id.encode()).hexdigest()

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _json(self, status: int, body, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _not_found(self, repo: str) -> None:
                self._json(404, {"error": "Repository not found"},
                           {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})

            def _serve(self) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append((self.command, path))
                if m := REVISION_RE.match(path):
                    repo = m.group(1)
                    if repo not in hub.repos:
                        return self._not_found(repo)
                    files = hub.repos[repo]
                    return self._json(200, {"id": repo, "modelId": repo, "sha": hub.sha(repo),
                                            "siblings": [{"rfilename": p} for p in files]})
                if m := TREE_RE.match(path):
                    repo = m.group(1)
                    if repo not in hub.repos:
                        return self._not_found(repo)
                    return self._json(200, [
                        {"type": "file", "path": p, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                        for p, d in hub.repos[repo].items()
                    ])
                if m := RESOLVE_RE.match(path):
                    repo, _rev, rel = m.groups()
                    if repo not in hub.repos:
                        return self._not_found(repo)
                    data = hub.repos[repo].get(rel)
                    if data is None:
                        return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
                    self.send_header("X-Repo-Commit", hub.sha(repo))
                    self.send_header("Content-Type", "application/octet-stream")
                    self.end_headers()
                    if self.command == "HEAD":
                        return None
                    for start in range(0, len(data), hub.chunk):
                        self.wfile.write(data[start:start + hub.chunk])
                        self.wfile.flush()
                        if hub.delay_per_chunk:
                            time.sleep(hub.delay_per_chunk)
                    return None
                return self._json(404, {"error": f"no route {path}"})

            do_GET = do_HEAD = _serve

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()
