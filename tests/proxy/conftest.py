"""Fixtures for the proxy tests: a real console process, real llama.cpp backends, and READY rows.

The rows are written into the console's own database with `manage.py shell` (setting state,
as the node agent would), on a node of their own so the console's agent never manages them.
"""
from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import KeyedConsole, LlamaServer, engine_command, start_console
from tests.procs import free_port, stop_process, wait_http

BACKEND_NODE = "gpu-b"
PROXY_MAX_BODY = 65536


class ProxyConsole(KeyedConsole):
    """A console whose instances the test writes directly (READY rows pointing at test backends)."""

    def set_instances(self, rows: list[dict], *, node_fresh: bool = True) -> list[int]:
        """Replace every instance on the backend node with `rows` ({name, port, type?, state?}); their ids."""
        code = f"""
import json
from datetime import timedelta
from django.utils import timezone
from hardware.models import Node
from serving.models import ModelInstance
rows = json.loads({json.dumps(json.dumps(rows))})
beat = timezone.now() if {node_fresh} else timezone.now() - timedelta(days=1)
node, _ = Node.objects.update_or_create(name={BACKEND_NODE!r}, defaults={{"address": "127.0.0.1", "last_heartbeat": beat}})
ModelInstance.objects.filter(node=node).delete()
ids = []
for i, row in enumerate(rows):
    replica = sum(1 for other in rows[:i] if other["name"] == row["name"])  # replicas of one name are numbered
    inst = ModelInstance.objects.create(
        model_name=row["name"], replica=replica, model_path="/models/tiny.gguf", type=row.get("type", "llm"),
        aliases=row.get("aliases", []), policy=row.get("policy", "always"),
        max_concurrency=row.get("max_concurrency"),
        backend=row.get("backend", "llama-cpp-python"), node=node, port=row["port"], state=row.get("state", "READY"),
        ready_at=timezone.now())
    ids.append(inst.pk)
print(json.dumps(ids))
"""
        out = self.console.manage("shell", "-c", code)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def wait_models(self, expected: set[str], *, timeout: float = 10.0) -> dict:
        """Poll /v1/models until it lists exactly `expected` (READY changes show within ~1 s)."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            listing = httpx.get(f"{self.url}/v1/models", headers=self.auth).json()
            if {m["id"] for m in listing["data"]} == expected or time.monotonic() > deadline:
                return listing
            time.sleep(0.1)


def _start_console(tmp_path_factory, server: str | None) -> Iterator[ProxyConsole]:
    console = start_console(
        tmp_path_factory.mktemp(f"proxy-console-{server or 'default'}"), server=server,
        # The backend node's heartbeat is written once by the test; keep it fresh for the module.
        extra_env={"XGEN_NODE_STALE_AFTER": "3600", "XGEN_NODE_OFFLINE_AFTER": "7200",
                   "XGEN_PROXY_MAX_BODY": str(PROXY_MAX_BODY)},
    )
    try:
        console.manage("createuser", "--username", "vera", "--role", "viewer", "--password", "vera-pass-123")
        key = console.manage("createapikey", "--username", "vera").stdout.strip().splitlines()[-1]
        yield ProxyConsole(console=console, key=key)
    finally:
        code = stop_process(console.proc, timeout=30)
    assert code == 0, f"console exited with {code}:\n{console.log[-3000:]}"
    assert "proxy failed" not in console.log, console.log[-5000:]  # never an unexpected error in the proxy
    assert "Unclosed" not in console.log, console.log[-5000:]  # the pooled client is closed at shutdown


@pytest.fixture(scope="module")
def proxy_console(tmp_path_factory) -> Iterator[ProxyConsole]:
    """A real `manage.py serve` on its default server (uvicorn, as in production) with a viewer's API key."""
    yield from _start_console(tmp_path_factory, None)


@pytest.fixture(scope="module")
def proxy_console_daphne(tmp_path_factory) -> Iterator[ProxyConsole]:
    """A real `manage.py serve --server daphne` with a viewer's API key (the tests that run on both servers)."""
    yield from _start_console(tmp_path_factory, "daphne")


@pytest.fixture(scope="session")
def tiny_gguf_b(tmp_path_factory) -> Path:
    """A second tiny model with other weights: its greedy output differs from tiny_gguf's."""
    from hub.demo import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("models-b") / "tiny-llama-b.gguf", seed=1)


class BackendPool:
    """Real llama.cpp servers for a module (llama-cpp-python's unless `engine` says otherwise);
    `log(server)` is its log (llama-cpp-python's has the access log)."""

    def __init__(self, tiny_gguf: Path, log_dir: Path) -> None:
        self.tiny_gguf = tiny_gguf
        self.log_dir = log_dir
        self.servers: list[LlamaServer] = []

    def start(self, alias: str, *, embedding: bool = False, model: Path | None = None,
              port: int | None = None, n_ctx: int = 512, engine: str = "llama-cpp-python",
              rerank: bool = False, context_shift: bool = False) -> LlamaServer:
        port = port or free_port()
        cmd, health = engine_command(engine, model=model or self.tiny_gguf, port=port, alias=alias,
                                     embedding=embedding, n_ctx=n_ctx, rerank=rerank, context_shift=context_shift)
        with open(self.log_dir / f"llama-{port}.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        server = LlamaServer(proc=proc, port=port, alias=alias, engine=engine)
        self.servers.append(server)
        wait_http(f"{server.base_url}{health}", timeout=60, proc=proc)
        return server

    def log(self, server: LlamaServer) -> str:
        return (self.log_dir / f"llama-{server.port}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for server in self.servers:
            stop_process(server.proc)


@pytest.fixture(scope="module")
def backends(tiny_gguf, tmp_path_factory) -> Iterator[BackendPool]:
    pool = BackendPool(tiny_gguf, tmp_path_factory.mktemp("llama-logs"))
    yield pool
    pool.stop_all()


@pytest.fixture
def sse_lines() -> Callable[[httpx.Response], Iterator[str]]:
    def lines(response: httpx.Response) -> Iterator[str]:
        for line in response.iter_lines():
            if line.startswith("data: "):
                yield line[len("data: "):]

    return lines


# ---------------------------------------------------------------- an echo backend
class AiohttpBackend:
    """An aiohttp app on a free loopback port, served from its own thread; subclasses add routes."""

    def __init__(self) -> None:
        import asyncio
        import threading

        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(10)

    def add_routes(self, app) -> None:
        raise NotImplementedError

    def _run(self, ready) -> None:
        import asyncio

        from aiohttp import web

        async def main() -> None:
            app = web.Application()
            self.add_routes(app)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port, backlog=1024).start()
            ready.set()

        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(main())
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class EchoBackend(AiohttpBackend):
    """A tiny OpenAI-shaped HTTP server that reports what it received.

    POST /v1/chat/completions answers JSON with the request's headers and a fixed usage;
    with "stream": true an SSE stream whose last chunk carries usage. POST /v1/completions
    drops the connection without answering; POST /v1/embeddings breaks off halfway through its JSON.
    """

    def add_routes(self, app) -> None:
        import asyncio

        from aiohttp import web

        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            seen = {k.lower(): v for k, v in request.headers.items()}
            usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
            if body.get("stream"):
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                for i in range(3):
                    chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": str(i)}}],
                             "usage": None}
                    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                final = {"object": "chat.completion.chunk", "choices": [], "usage": usage}
                await response.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
                await response.write_eof()
                return response
            return web.json_response(
                {"object": "chat.completion", "headers": seen, "body": body, "usage": usage},
                headers={"X-Backend": "echo", "Set-Cookie": "backend=1"},
            )

        async def drop(request: web.Request) -> web.Response:
            request.transport.close()  # gone before a single byte of an answer
            return web.Response()

        async def cut(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await response.write(b'{"object": "list", "data": [{"embedding": [0.1, ')
            await asyncio.sleep(0.05)
            request.transport.close()  # dies halfway through the JSON
            return response

        app.router.add_post("/v1/embeddings", cut)
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_post("/v1/completions", drop)


@pytest.fixture(scope="module")
def echo_backend() -> Iterator[EchoBackend]:
    echo = EchoBackend()
    yield echo
    echo.stop()
