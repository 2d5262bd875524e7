#!/usr/bin/env python
"""What the inference proxy costs: a backend called directly vs through the console, in one run.

    python bench/proxy_overhead.py [--servers uvicorn,daphne] [--scale 1.0] [--gaps 0.02,1.2,35]

On loopback: a minimal fast upstream (aiohttp, OpenAI-shaped JSON and a fast SSE stream) for the
overhead figures, and a real llama-cpp-python server on the tiny model for time to first chunk.
The console runs as a real `manage.py serve --server uvicorn|daphne` process. Prints, per
server: added latency p50/p99 for small non-streaming requests at concurrency 1, 16 and 64,
requests per second, time to first chunk, and throughput at 64 concurrent streams, each next to
the direct baseline measured in the same run. Targets: added p50 <= 3 ms, TTFC <= +5 ms,
throughput loss <= 10 % at 64 streams.

64 unpaced streams (a backend writing 100 events as fast as it can, 64 at a time) are CPU-bound:
the client and the backend alone fill two cores, so on a 2-core machine any proxy's CPU is taken
from them and the loss measures the proxy's CPU per stream (printed per process, from /proc),
against the minimal proxy's in the same rounds. `--pin` gives the proxies a core of their own
(CPU 1; the client and the backends CPU 0), as on a GPU server, where the loss says whether the
proxy keeps up: `--only streams --pin` for that figure alone.

The passthrough routes (issue 15: any POST /v1/<path> naming a model, the engines' routes as
/api/inference/<route>) are measured beside chat in the same rounds: /v1/rerank (to a rerank row)
and /api/inference/tokenize, each as added p50 over direct, as a ratio to the minimal proxy's, and
as a difference from the console's own chat figure (target: +0.2 ms at most).

A minimal pooled-aiohttp proxy (30 lines, below) runs beside the console as a second baseline,
and for small requests a floor: uvicorn and the console's own HTTP/1.1 client with nothing else,
the most req/s any proxy on the console's stack can reach on this machine (as a ratio to the
minimal proxy's: the client and the backend share the cores with it), and nginx when installed
(the stretch target: the console's added p50 within +1 ms of nginx's). The idle-gap probe sends
one request, then (after another gap) one stream, to each target after idle gaps like a real
client's (0.02 s, 1.2 s, 35 s): back-to-back benchmarks never see caches that expire between
requests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

ANSWER = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "fast",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}).encode()
STREAM_CHUNKS = 100
CHUNK = b"data: " + json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "fast",
    "choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}],
}).encode() + b"\n\n"
# The last chunk of a stream whose client asked for usage (the console asks for every stream it
# relays, to bill it): without it the console would ask the engine to count the prompt afterwards.
USAGE_CHUNK = b"data: " + json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "fast", "choices": [],
    "usage": {"prompt_tokens": 9, "completion_tokens": STREAM_CHUNKS, "total_tokens": 9 + STREAM_CHUNKS},
}).encode() + b"\n\n"
ROUNDS = 3
SMALL = {"model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
RERANK_ANSWER = json.dumps({
    "model": "fast-rr", "object": "list", "usage": {"prompt_tokens": 12, "total_tokens": 12},
    "results": [{"index": 1, "relevance_score": 0.9}, {"index": 0, "relevance_score": 0.1}],
}).encode()
TOKENIZE_ANSWER = json.dumps({"tokens": [15339, 1917]}).encode()
# (label, path on the console and the minimal proxy, path on the backend, body): chat first, the baseline.
PASSTHROUGH = [
    ("chat", "/v1/chat/completions", "/v1/chat/completions", SMALL),
    ("rerank", "/v1/rerank", "/v1/rerank", {"model": "fast-rr", "query": "hi", "documents": ["a", "b"]}),
    ("tokenize", "/api/inference/tokenize", "/tokenize", {"model": "fast", "content": "hello world"}),
]


# ---------------------------------------------------------------- the fast upstream (own process)
def run_upstream(port: int) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if not body.get("stream"):
            return web.Response(body=ANSWER, content_type="application/json")
        pace = body.get("pace_ms", 0) / 1000  # > 0: one chunk per pace, like a backend generating tokens
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(STREAM_CHUNKS):
            await response.write(CHUNK)
            if pace:
                await asyncio.sleep(pace)
        if (body.get("stream_options") or {}).get("include_usage"):  # as llama.cpp's engines and vLLM answer it
            await response.write(USAGE_CHUNK)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def rerank(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=RERANK_ANSWER, content_type="application/json")

    async def tokenize(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=TOKENIZE_ANSWER, content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fast", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/rerank", rerank)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# ---------------------------------------------------------------- the minimal proxy (own process)
def run_minimal_proxy(port: int, upstream_port: int) -> None:
    """The least a Python proxy can do: one pooled aiohttp client, bytes passed through as they come."""
    import aiohttp
    from aiohttp import web

    async def forward(request: web.Request) -> web.StreamResponse:
        session = request.app["session"]
        body = await request.read()
        path = request.path.removeprefix("/api/inference")  # the engines' routes, as the console maps them
        async with session.post(f"http://127.0.0.1:{upstream_port}{path}", data=body,
                                headers={"Content-Type": "application/json"}) as upstream:
            response = web.StreamResponse(status=upstream.status,
                                          headers={"Content-Type": upstream.headers.get("Content-Type", "")})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def close(app: web.Application) -> None:
        await app["session"].close()

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(close)
    app.router.add_post("/v1/{tail:.*}", forward)
    app.router.add_post("/api/inference/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def run_floor_proxy(port: int, upstream_port: int) -> None:
    """The floor of the console's own stack: uvicorn (httptools) and the console's HTTP/1.1 client
    (serving/proxy/http1.py), a request read, forwarded and answered, and nothing else (no auth,
    routing, limits or accounting). Its req/s over the minimal proxy's is the most any proxy on
    this stack can reach on this machine, with the client and the backend beside it."""
    sys.path.insert(0, str(REPO))
    import uvicorn

    from serving.proxy import http1

    base = f"http://127.0.0.1:{upstream_port}"
    state: dict[str, http1.Client] = {}

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        client = state.get("client") or state.setdefault("client", http1.Client(connect_timeout_s=5))
        parts, more = [], True
        while more:
            message = await receive()
            parts.append(message.get("body", b""))
            more = message.get("more_body", False)
        path = scope["path"].removeprefix("/api/inference")
        answer = await client.post(base, path, b"".join(parts), b"content-type: application/json\r\n")
        await send({"type": "http.response.start", "status": answer.status,
                    "headers": [(k, v) for k, v in answer.headers if k in (b"content-type", b"content-length")]})
        async for chunk in answer.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        answer.release()

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off",
                http="httptools")


def start_nginx(port: int, upstream_port: int, workdir: Path) -> subprocess.Popen | None:
    """nginx as a reverse proxy to the fast upstream (a keep-alive pool, no buffering), when it is
    installed (Debian: nginx-light): the stretch target's baseline. None without nginx."""
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if binary is None:
        return None
    home = workdir / "nginx"
    home.mkdir(exist_ok=True)
    temp = " ".join(f"{kind}_temp_path {home}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi",
                                                                    "scgi"))
    (home / "nginx.conf").write_text(f"""
{"user root;" if os.geteuid() == 0 else ""}
worker_processes 1;
daemon off;
pid {home}/nginx.pid;
error_log {home}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  {temp}
  upstream fast {{ server 127.0.0.1:{upstream_port}; keepalive 256; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{ proxy_pass http://fast; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; }}
  }}
}}
""")
    return subprocess.Popen([binary, "-p", str(home), "-c", str(home / "nginx.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# ---------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(url)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ConsoleProcess:
    """A real `manage.py serve` with its own data dir, a viewer key, and READY rows for the backends."""

    def __init__(self, server: str, workdir: Path, backends: dict[str, int], serve_args: tuple[str, ...] = (),
                 *, tag: str = "", env: dict | None = None, max_concurrency: int | None = None,
                 limited_key: bool = True) -> None:
        self.port = free_port()
        server, _, loop = server.partition(":")  # "uvicorn:uvloop", "uvicorn:asyncio"
        data = workdir / f"console-{server}-{loop or 'default'}{'-'.join(('', *serve_args)).replace('--', '')}{tag}"
        self.env = {**os.environ, "DJANGO_SETTINGS_MODULE": "xgenconsole.settings", "XGEN_DATA_DIR": str(data),
                    "XGEN_NODE_NAME": "bench-web", "XGEN_DEMO_MODEL": "false", "XGEN_ADMIN_PASSWORD": "bench-pass-123",
                    "XGEN_NODE_STALE_AFTER": "3600", "XGEN_NODE_OFFLINE_AFTER": "7200", "XGEN_LOG_LEVEL": "WARNING",
                    **(env or {})}
        for cmd in (["migrate", "-v0"], ["ensureadmin"],
                    ["createuser", "--username", "bench", "--role", "viewer", "--password", "bench-pass-123"]):
            self.manage(*cmd)
        # A key with (generous) limits where this version has them: the limiter, the usage buckets and
        # the request log all run on every request, as they do for a limited key in production.
        limited = limited_key and "--rpm" in self.manage("createapikey", "--help")
        self.key_kind = "a limited key (rpm, tpm)" if limited else "an unlimited key (no key limits in this version)"
        self.key = self.manage("createapikey", "--username", "bench",
                               *(["--rpm", "10000000", "--tpm", "1000000000"] if limited else [])).split()[-1]
        # A name ending in -rr is a rerank model (the console sends /v1/rerank to rerank models only).
        rows = json.dumps([{"name": n, "port": p, "type": "rerank" if n.endswith("-rr") else "llm"}
                           for n, p in backends.items()])
        self.manage("shell", "-c", f"""
import json
from django.utils import timezone
from hardware.models import Node
from serving.models import ModelInstance
node, _ = Node.objects.update_or_create(name="bench-node", defaults={{"address": "127.0.0.1", "last_heartbeat": timezone.now()}})
for row in json.loads({rows!r}):
    ModelInstance.objects.create(model_name=row["name"], model_path="/bench", backend="bench", node=node,
                                 port=row["port"], state="READY", ready_at=timezone.now(), type=row["type"],
                                 max_concurrency={max_concurrency!r})
""")
        self.log = open(data / "serve.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [PYTHON, str(REPO / "manage.py"), "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--server", server, "--no-agent", *(["--loop", loop] if loop else []), *serve_args],
            env=self.env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
        )
        wait_http(f"{self.url}/healthz", self.proc)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def manage(self, *args: str) -> str:
        return subprocess.run([PYTHON, str(REPO / "manage.py"), *args], env=self.env, cwd=REPO, check=True,
                              capture_output=True, text=True, timeout=120).stdout

    def stop(self) -> None:
        stop(self.proc)
        self.log.close()


# ---------------------------------------------------------------- measurements
def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def small_requests(session, url: str, headers: dict, n: int, concurrency: int,
                         payload: dict = SMALL) -> tuple[list[float], float]:
    """Latencies (s) of n small non-streaming requests at `concurrency`, and the wall time."""
    body = json.dumps(payload).encode()
    latencies: list[float] = []
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - start


async def one_stream(session, url: str, headers: dict, body: bytes) -> tuple[float, float, int]:
    """(time to first chunk, total time, bytes) of one streamed answer."""
    t0 = time.perf_counter()
    first = None
    size = 0
    async with session.post(url, data=body, headers=headers) as r:
        assert r.status == 200, r.status
        async for chunk in r.content.iter_any():
            if first is None:
                first = time.perf_counter() - t0
            size += len(chunk)
    return first, time.perf_counter() - t0, size


async def streams(session, url: str, headers: dict, body: dict, n: int, concurrency: int
                  ) -> tuple[list[float], float, int]:
    """TTFCs (s) of n streams at `concurrency`, the wall time, and the bytes received."""
    raw = json.dumps(body).encode()
    ttfc: list[float] = []
    total_bytes = 0
    left = n

    async def worker() -> None:
        nonlocal left, total_bytes
        while left > 0:
            left -= 1
            first, _, size = await one_stream(session, url, headers, raw)
            ttfc.append(first)
            total_bytes += size

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfc, time.perf_counter() - start, total_bytes


async def measure(server: str, console: ConsoleProcess, fast_port: int, llama_port: int, minimal_port: int,
                  pids: dict[str, int], scale: float, floor_port: int, nginx_port: int | None) -> list[str]:
    import aiohttp

    auth = {"Authorization": f"Bearer {console.key}", "Content-Type": "application/json"}
    plain = {"Content-Type": "application/json"}
    direct_url = f"http://127.0.0.1:{fast_port}/v1/chat/completions"
    proxy_url = f"{console.url}/v1/chat/completions"
    minimal_url = f"http://127.0.0.1:{minimal_port}/v1/chat/completions"
    floor_url = f"http://127.0.0.1:{floor_port}/v1/chat/completions"
    nginx_url = f"http://127.0.0.1:{nginx_port}/v1/chat/completions" if nginx_port else None
    lines = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await small_requests(session, direct_url, plain, 100, 4)  # warm both paths and pools
        await small_requests(session, proxy_url, auth, 200, 8)
        for concurrency, n in ((1, 400), (16, 2000), (64, 3000)):
            n = max(concurrency * 4, int(n * scale)) // ROUNDS * ROUNDS
            d_lat, p_lat, m_lat, d_wall, p_wall, m_wall, f_wall = [], [], [], 0.0, 0.0, 0.0, 0.0
            n_lat, n_wall = [], 0.0
            for _ in range(ROUNDS):  # interleaved, so drift on a shared machine hits every side
                f_wall += (await small_requests(session, floor_url, plain, n // ROUNDS, concurrency))[1]
                if nginx_url:
                    lat, wall = await small_requests(session, nginx_url, plain, n // ROUNDS, concurrency)
                    n_lat, n_wall = n_lat + lat, n_wall + wall
                lat, wall = await small_requests(session, direct_url, plain, n // ROUNDS, concurrency)
                d_lat, d_wall = d_lat + lat, d_wall + wall
                lat, wall = await small_requests(session, proxy_url, auth, n // ROUNDS, concurrency)
                p_lat, p_wall = p_lat + lat, p_wall + wall
                lat, wall = await small_requests(session, minimal_url, plain, n // ROUNDS, concurrency)
                m_lat, m_wall = m_lat + lat, m_wall + wall
            added = pct(p_lat, .5) - pct(d_lat, .5)
            m_added = pct(m_lat, .5) - pct(d_lat, .5)
            lines.append(
                f"{server:8} small c={concurrency:<3} minimal proxy p50 {1000 * pct(m_lat, .5):6.2f} ms "
                f"{n / m_wall:6.0f} req/s, added p50 {1000 * m_added:+6.2f} ms | console/minimal: added p50 "
                f"{added / m_added if m_added > 0 else float('nan'):.2f}x, req/s {m_wall / p_wall:.2f}x"
            )
            lines.append(
                f"{server:8} small c={concurrency:<3} floor (uvicorn + the console's client, nothing else) "
                f"{n / f_wall:6.0f} req/s = {m_wall / f_wall:.2f}x the minimal proxy's (the most a proxy on this "
                f"stack reaches here) | console/floor req/s {f_wall / p_wall:.2f}x"
            )
            if nginx_url:
                n_added = pct(n_lat, .5) - pct(d_lat, .5)
                lines.append(
                    f"{server:8} small c={concurrency:<3} nginx p50 {1000 * pct(n_lat, .5):6.2f} ms {n / n_wall:6.0f} "
                    f"req/s, added p50 {1000 * n_added:+6.2f} ms | console's added p50 - nginx's "
                    f"{1000 * (added - n_added):+.2f} ms (stretch: <= +1 ms), req/s {n_wall / p_wall:.2f}x nginx's"
                )
            lines.append(
                f"{server:8} small c={concurrency:<3} n={n:<5} direct p50 {1000 * pct(d_lat, .5):6.2f} ms "
                f"p99 {1000 * pct(d_lat, .99):6.2f} ms {n / d_wall:6.0f} req/s | proxy p50 "
                f"{1000 * pct(p_lat, .5):6.2f} ms p99 {1000 * pct(p_lat, .99):6.2f} ms {n / p_wall:6.0f} req/s | "
                f"added p50 {1000 * (pct(p_lat, .5) - pct(d_lat, .5)):+6.2f} ms p99 "
                f"{1000 * (pct(p_lat, .99) - pct(d_lat, .99)):+6.2f} ms"
            )
        stream_body = {**SMALL, "stream": True}
        n = max(20, int(200 * scale))
        d_ttfc, _, _ = await streams(session, direct_url, plain, stream_body, n, 1)
        p_ttfc, _, _ = await streams(session, proxy_url, auth, stream_body, n, 1)
        lines.append(
            f"{server:8} TTFC fast upstream n={n}: direct p50 {1000 * pct(d_ttfc, .5):.2f} ms | proxy p50 "
            f"{1000 * pct(p_ttfc, .5):.2f} ms | added {1000 * (pct(p_ttfc, .5) - pct(d_ttfc, .5)):+.2f} ms "
            f"(p99 {1000 * (pct(p_ttfc, .99) - pct(d_ttfc, .99)):+.2f} ms)"
        )
        llama_body = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 4, "stream": True}
        n = max(6, int(20 * scale))
        d_ttfc, p_ttfc = [], []
        for _ in range(n):  # interleaved: the backend's own speed drifts
            d_ttfc += (await streams(session, f"http://127.0.0.1:{llama_port}/v1/completions", plain,
                                     llama_body, 1, 1))[0]
            p_ttfc += (await streams(session, f"{console.url}/v1/completions", auth, llama_body, 1, 1))[0]
        lines.append(
            f"{server:8} TTFC llama-cpp-python n={n}: direct median {1000 * statistics.median(d_ttfc):.2f} ms | "
            f"proxy median {1000 * statistics.median(p_ttfc):.2f} ms | added "
            f"{1000 * (statistics.median(p_ttfc) - statistics.median(d_ttfc)):+.2f} ms"
        )
        paced = {**stream_body, "pace_ms": 10}  # 100 tokens/s per stream, 6,400 chunks/s in all
        n = max(64, int(64 * 2 * scale))
        _, d_wall, d_bytes = await streams(session, direct_url, plain, paced, n, 64)
        _, p_wall, p_bytes = await streams(session, proxy_url, auth, paced, n, 64)
        d_rate, p_rate = d_bytes / d_wall, p_bytes / p_wall
        lines.append(
            f"{server:8} 64 concurrent streams x{n} at 100 tokens/s each: direct {d_bytes / d_wall / len(CHUNK):.0f} "
            f"chunks/s | proxy {p_bytes / p_wall / len(CHUNK):.0f} chunks/s | throughput loss "
            f"{100 * (1 - p_rate / d_rate):.1f} %"
        )
    return lines + await unpaced_streams(server, console, fast_port, minimal_port, pids, scale)


async def protocol_cpu(scale: float) -> list[str]:
    """CPU per keep-alive request of uvicorn's httptools protocol and of the console's guarded one,
    driven in this process with an in-memory transport and a two-byte app (no sockets, no client,
    no console): the limits' own cost, apart from the machine's noise."""
    from uvicorn.config import Config
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    from xgenconsole.http_edge import guarded_protocol

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    class Transport(asyncio.Transport):
        def __init__(self) -> None:
            super().__init__()
            self.protocol = None

        def write(self, data) -> None:
            pass

        def is_closing(self) -> bool:
            return False

        def close(self) -> None:
            pass

        def get_extra_info(self, name, default=None):
            return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            pass

        def get_protocol(self):
            return self.protocol

    config = Config(app, log_level="warning", lifespan="off")
    config.load()
    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n" \
              b"Authorization: Bearer xgen_bench\r\nContent-Length: 2\r\n\r\n{}"
    classes = {"plain": HttpToolsProtocol,
               "guarded": guarded_protocol(head_timeout_s=20, max_head_bytes=64 * 1024, max_connections=1000)}
    n = max(2000, int(20000 * scale)) // ROUNDS
    cpu = dict.fromkeys(classes, 0.0)
    for i in range(ROUNDS * 2):
        for name in (list(classes) if i % 2 == 0 else list(classes)[::-1]):
            state = ServerState()
            protocol = classes[name](config=config, server_state=state, app_state={})
            transport = Transport()
            transport.protocol = protocol
            protocol.connection_made(transport)
            t0 = time.process_time()
            for _ in range(n):
                protocol.data_received(request)
                await asyncio.gather(*list(state.tasks))
            cpu[name] += time.process_time() - t0
            protocol.connection_lost(None)
    total = n * ROUNDS * 2
    plain, guarded = (1e6 * cpu[k] / total for k in ("plain", "guarded"))
    return [f"uvicorn  head limits in process, {total} keep-alive requests each: uvicorn's protocol {plain:.1f} us "
            f"CPU a request | with the limits {guarded:.1f} us ({guarded - plain:+.1f} us, {guarded / plain:.3f}x)"]


async def head_limits(plain: ConsoleProcess, guarded: ConsoleProcess, scale: float) -> list[str]:
    """req/s of small requests through uvicorn's own httptools protocol (today's) and through the
    console's with the head deadline, head cap and connection cap (xgenconsole/http_edge.py), in
    the same rounds, interleaved."""
    import aiohttp

    lines = []
    pids = {"plain": plain.proc.pid, "guarded": guarded.proc.pid}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        targets = {name: (f"{c.url}/v1/chat/completions",
                          {"Authorization": f"Bearer {c.key}", "Content-Type": "application/json"})
                   for name, c in (("plain", plain), ("guarded", guarded))}
        for url, headers in targets.values():
            await small_requests(session, url, headers, 200, 8)  # warm both
        for concurrency, n in ((1, 400), (16, 2000), (64, 3000)):
            n = max(concurrency * 4, int(n * scale)) // ROUNDS * ROUNDS
            walls, cpus = dict.fromkeys(targets, 0.0), dict.fromkeys(targets, 0.0)
            lats: dict[str, list[float]] = {name: [] for name in targets}
            for i in range(ROUNDS):
                for name in (list(targets) if i % 2 == 0 else list(targets)[::-1]):  # each goes first in turn
                    url, headers = targets[name]
                    cpu = cpu_seconds(pids[name])
                    lat, wall = await small_requests(session, url, headers, n // ROUNDS, concurrency)
                    cpus[name] += cpu_seconds(pids[name]) - cpu
                    lats[name] += lat
                    walls[name] += wall
            # CPU per request (the console process's, from /proc) is what a busy shared machine disturbs least.
            lines.append(
                f"uvicorn  head limits c={concurrency:<3} n={n:<5} today's protocol {n / walls['plain']:6.0f} req/s "
                f"p50 {1000 * pct(lats['plain'], .5):.2f} ms CPU {1e6 * cpus['plain'] / n:.0f} us/req | with the "
                f"limits {n / walls['guarded']:6.0f} req/s p50 {1000 * pct(lats['guarded'], .5):.2f} ms CPU "
                f"{1e6 * cpus['guarded'] / n:.0f} us/req | req/s ratio {walls['plain'] / walls['guarded']:.3f}x, "
                f"CPU ratio {cpus['guarded'] / cpus['plain']:.3f}x"
            )
    return lines


async def passthrough(server: str, console: ConsoleProcess, fast_port: int, minimal_port: int,
                      scale: float) -> list[str]:
    """The passthrough routes beside chat, at concurrency 1, every route and target interleaved in
    each round: added p50 over direct, the ratio to the minimal proxy's, and the difference from
    the console's chat figure measured in the same rounds."""
    import aiohttp

    auth = {"Authorization": f"Bearer {console.key}", "Content-Type": "application/json"}
    plain = {"Content-Type": "application/json"}
    # name -> (base URL, headers, whether it is the backend itself: it takes the backend's path)
    targets = {"direct": (f"http://127.0.0.1:{fast_port}", plain, True),
               "minimal": (f"http://127.0.0.1:{minimal_port}", plain, False), "console": (console.url, auth, False)}
    n = max(60, int(600 * scale)) // ROUNDS * ROUNDS
    lat: dict[tuple[str, str], list[float]] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for warm in (True, False):  # a first pass warms every path and pool, then the measured rounds
            for _ in range(1 if warm else ROUNDS):
                for label, path, backend_path, body in PASSTHROUGH:
                    for name, (base, headers, is_backend) in targets.items():
                        url = base + (backend_path if is_backend else path)
                        got, _ = await small_requests(session, url, headers, 50 if warm else n // ROUNDS, 1, body)
                        if not warm:
                            lat.setdefault((label, name), []).extend(got)
    lines = []
    chat_added = pct(lat[("chat", "console")], .5) - pct(lat[("chat", "direct")], .5)
    for label, path, _, _ in PASSTHROUGH:
        direct = pct(lat[(label, "direct")], .5)
        minimal = pct(lat[(label, "minimal")], .5) - direct
        added = pct(lat[(label, "console")], .5) - direct
        vs_chat = "" if label == "chat" else f" | vs the console's chat {1000 * (added - chat_added):+.2f} ms"
        lines.append(
            f"{server:8} passthrough c=1 n={n} {label:8} {path:24} direct p50 {1000 * direct:5.2f} ms | minimal "
            f"added {1000 * minimal:+5.2f} ms | console added {1000 * added:+5.2f} ms = "
            f"{added / minimal if minimal > 0 else float('nan'):.2f}x the minimal proxy's{vs_chat}"
        )
    return lines


async def admission(consoles: dict[str, ConsoleProcess], fast_port: int, scale: float) -> list[str]:
    """Issue 25 #1: the added p50 at c=1 of a model with max_concurrency (1000: never full) admitted
    in-process (no REDIS_URL) vs in Redis (cluster mode), and, in Redis mode, of the same model
    without max_concurrency (no admission: what REDIS_URL costs otherwise). Unlimited keys, so the
    rate limiter asks nothing of Redis; interleaved rounds against one direct baseline."""
    import aiohttp

    plain = {"Content-Type": "application/json"}
    direct_url = f"http://127.0.0.1:{fast_port}/v1/chat/completions"
    n = max(ROUNDS * 20, int(1200 * scale)) // (ROUNDS * 3) * (ROUNDS * 3)
    lats: dict[str, list[float]] = {"direct": [], **{name: [] for name in consoles}}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for console in consoles.values():  # warm every path, pool and script cache
            await small_requests(session, f"{console.url}/v1/chat/completions",
                                 {**plain, "Authorization": f"Bearer {console.key}"}, 100, 1)
        for _ in range(ROUNDS * 3):
            lats["direct"] += (await small_requests(session, direct_url, plain, n // (ROUNDS * 3), 1))[0]
            for name, console in consoles.items():
                lats[name] += (await small_requests(session, f"{console.url}/v1/chat/completions",
                                                    {**plain, "Authorization": f"Bearer {console.key}"},
                                                    n // (ROUNDS * 3), 1))[0]
    direct = pct(lats["direct"], .5)
    added = {name: pct(lats[name], .5) - direct for name in consoles}
    lines = [f"admission c=1 n={n}: direct p50 {1000 * direct:.3f} ms"]
    lines += [f"admission c=1 {name:22} p50 {1000 * pct(lats[name], .5):.3f} ms, added p50 {1000 * added[name]:+.3f} ms"
              for name in consoles]
    lines.append(f"admission c=1 Redis admission - in-process admission: added p50 "
                 f"{1000 * (added['redis-admission'] - added['in-process']):+.3f} ms (target <= +0.3 ms)")
    return lines


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (and its reaped children) so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


async def unpaced_streams(server: str, console: ConsoleProcess, fast_port: int, minimal_port: int,
                          pids: dict[str, int], scale: float) -> list[str]:
    """64 unpaced streams to each target, interleaved over rounds: throughput, its loss against
    direct, and the CPU each process spent per stream (where a loss on a small machine goes)."""
    import aiohttp

    stream_body = {**SMALL, "stream": True}
    auth = {"Authorization": f"Bearer {console.key}", "Content-Type": "application/json"}
    plain = {"Content-Type": "application/json"}
    targets = {"direct": (f"http://127.0.0.1:{fast_port}/v1/chat/completions", plain),
               "minimal": (f"http://127.0.0.1:{minimal_port}/v1/chat/completions", plain),
               "console": (f"{console.url}/v1/chat/completions", auth)}
    procs = {**pids, "console": console.proc.pid, "client": os.getpid()}
    n = max(640, int(64 * 20 * scale))  # per target and round: about a second each, not a few ms
    wall = dict.fromkeys(targets, 0.0)
    size = dict.fromkeys(targets, 0)
    cpu = {t: dict.fromkeys(procs, 0.0) for t in targets}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for url, headers in targets.values():  # warm every pool
            await streams(session, url, headers, stream_body, 64, 64)
        for _ in range(ROUNDS):
            for name, (url, headers) in targets.items():
                before = {p: cpu_seconds(pid) for p, pid in procs.items()}
                _, w, b = await streams(session, url, headers, stream_body, n, 64)
                wall[name] += w
                size[name] += b
                for p, pid in procs.items():
                    cpu[name][p] += cpu_seconds(pid) - before[p]
    total = n * ROUNDS
    lines = []
    direct_rate = size["direct"] / wall["direct"]
    minimal_rate = size["minimal"] / wall["minimal"]
    for name in targets:
        rate = size[name] / wall[name]
        spent = ", ".join(f"{p} {1e6 * c / total:.0f}" for p, c in cpu[name].items() if c > 0.005)
        vs = f" = {rate / minimal_rate:.2f}x the minimal proxy's" if name == "console" else ""
        lines.append(f"{server:8} 64 unpaced streams x{total} ({STREAM_CHUNKS} chunks) {name:8} "
                     f"{total / wall[name]:5.0f} streams/s {rate / 1e6:5.2f} MB/s, loss vs direct "
                     f"{100 * (1 - rate / direct_rate):5.1f} %{vs} | CPU us per stream: {spent}")
    return lines


async def idle_gaps(targets: dict[str, tuple[str, dict]], gaps: list[float], samples: int) -> list[str]:
    """After each idle gap, one small request to each target, and after another gap of the same
    length one stream to each (its time to first chunk); p50/p90 per gap, and each target's added
    latency over direct as a ratio to the minimal proxy's. `samples` is rounded up to a multiple of
    the number of targets, so that each goes first after a gap equally often."""
    import aiohttp

    body = json.dumps(SMALL).encode()
    stream_body = json.dumps({**SMALL, "stream": True}).encode()
    lines = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for url, headers in targets.values():  # open every pool first: a gap, not a first connect, is measured
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
        for gap in gaps:
            times: dict[str, list[float]] = {name: [] for name in targets}
            ttfc: dict[str, list[float]] = {name: [] for name in targets}
            names = list(targets)
            taken = -(-samples // len(names)) * len(names)  # a multiple of the targets
            for sample in range(taken):
                # Whoever goes first after a gap also wakes what the targets share (the backend, the
                # client, idle CPUs): the order turns each sample, so each target goes first as often.
                turn = names[sample % len(names):] + names[:sample % len(names)]
                await asyncio.sleep(gap)
                for name in turn:
                    url, headers = targets[name]
                    t0 = time.perf_counter()
                    async with session.post(url, data=body, headers=headers) as r:
                        await r.read()
                        assert r.status == 200, (name, r.status)
                    times[name].append(time.perf_counter() - t0)
                await asyncio.sleep(gap)
                for name in turn:
                    url, headers = targets[name]
                    first, _, _ = await one_stream(session, url, headers, stream_body)
                    ttfc[name].append(first)
            for label, got in (("small", times), ("TTFC ", ttfc)):
                direct50, direct90 = pct(got["direct"], .5), pct(got["direct"], .9)
                minimal50 = pct(got["minimal"], .5) - direct50
                minimal90 = pct(got["minimal"], .9) - direct90
                for name, values in got.items():
                    add50, add90 = pct(values, .5) - direct50, pct(values, .9) - direct90
                    ratio = "" if name in ("direct", "minimal") else (
                        f" = {add50 / minimal50:.2f}x / {add90 / minimal90:.2f}x the minimal proxy's"
                        if minimal50 > 0 and minimal90 > 0 else "")
                    lines.append(f"idle gap {gap:>5g} s n={taken:<3} {label} {name:16} p50 "
                                 f"{1000 * pct(values, .5):6.2f} ms p90 {1000 * pct(values, .9):6.2f} ms | added p50 "
                                 f"{1000 * add50:+6.2f} ms p90 {1000 * add90:+6.2f} ms{ratio}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    import importlib.util

    servers = "uvicorn:asyncio,uvicorn:uvloop,daphne" if importlib.util.find_spec("uvloop") else "uvicorn,daphne"
    parser.add_argument("--servers", default=servers,
                        help="consoles to measure: daphne, uvicorn[:asyncio|:uvloop] (uvloop only when installed)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    parser.add_argument("--gaps", default="0.02,1.2,35", help="idle gaps (s) for the probe; empty: skip it")
    parser.add_argument("--gap-samples", type=int, default=6,
                        help="requests per target per gap (rounded up to a multiple of the targets)")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/11",
                        help="--only admission: the Redis of the cluster-mode consoles (a db of their own)")
    parser.add_argument("--only", choices=["all", "passthrough", "streams", "edge", "admission"], default="all",
                        help="passthrough: only the passthrough routes beside chat (and the idle gaps); "
                             "streams: only 64 unpaced streams, direct / minimal proxy / console, with CPU time; "
                             "edge: req/s of uvicorn with and without the request-head limits, same rounds; "
                             "admission: added p50 at c=1 with max_concurrency admitted in-process vs in Redis "
                             "(cluster mode, --redis), same rounds")
    parser.add_argument("--pin", action="store_true",
                        help="give the proxies (console, minimal) CPU 1 and everything else CPU 0, as on a server "
                             "where clients and backends are not on the proxy's cores")
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--minimal-proxy", help=argparse.SUPPRESS)
    parser.add_argument("--floor-proxy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.upstream:
        run_upstream(args.upstream)
        return
    if args.minimal_proxy:
        port, upstream_port = args.minimal_proxy.split(":")
        run_minimal_proxy(int(port), int(upstream_port))
        return
    if args.floor_proxy:
        port, upstream_port = args.floor_proxy.split(":")
        run_floor_proxy(int(port), int(upstream_port))
        return
    sys.path.insert(0, str(REPO))
    if args.pin:
        os.sched_setaffinity(0, {0})  # this client and every backend started below
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="xgen-bench-") as tmp:
        work = Path(tmp)
        try:
            fast_port = free_port()
            upstream = subprocess.Popen([PYTHON, __file__, "--upstream", str(fast_port)])
            procs.append(upstream)
            os.environ.setdefault("DJANGO_SETTINGS_MODULE", "xgenconsole.settings")
            os.environ["XGEN_DATA_DIR"] = str(work / "gguf")
            from hardware.backends import export_llama_cpp_lib_path
            from hub.demo import write_tiny_llama_gguf

            export_llama_cpp_lib_path()  # as the console does at start: a llama-cpp-python without its own libllama

            model = write_tiny_llama_gguf(work / "tiny.gguf", seed=0)
            llama_port = free_port()
            llama = subprocess.Popen(
                [PYTHON, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port",
                 str(llama_port), "--model_alias", "tiny", "--n_ctx", "512", "--verbose", "false"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            procs.append(llama)
            minimal_port = free_port()
            minimal = subprocess.Popen([PYTHON, __file__, "--minimal-proxy", f"{minimal_port}:{fast_port}"])
            procs.append(minimal)
            floor_port = free_port()
            floor = subprocess.Popen([PYTHON, __file__, "--floor-proxy", f"{floor_port}:{fast_port}"])
            procs.append(floor)
            nginx_port = free_port()
            nginx = start_nginx(nginx_port, fast_port, work)
            if nginx is None:
                nginx_port = None
                print("nginx is not installed (Debian: nginx-light): its baseline is left out")
            else:
                procs.append(nginx)
            if args.pin:
                os.sched_setaffinity(minimal.pid, {1})
                os.sched_setaffinity(floor.pid, {1})
            wait_http(f"http://127.0.0.1:{fast_port}/v1/models", upstream)
            wait_http(f"http://127.0.0.1:{floor_port}/v1/models", floor)
            if nginx is not None:
                wait_http(f"http://127.0.0.1:{nginx_port}/v1/models", nginx)
            wait_http(f"http://127.0.0.1:{llama_port}/v1/models", llama)
            wait_http(f"http://127.0.0.1:{minimal_port}/v1/models", minimal)
            print(f"proxy overhead on loopback, {os.cpu_count()} CPUs; every 'direct' is measured in this run")
            plain = {"Content-Type": "application/json"}
            targets = {"direct": (f"http://127.0.0.1:{fast_port}/v1/chat/completions", plain),
                       "minimal": (f"http://127.0.0.1:{minimal_port}/v1/chat/completions", plain)}
            consoles = []
            try:
                if args.only == "admission":
                    import redis

                    redis.Redis.from_url(args.redis).flushdb()
                    backends = {"fast": fast_port}
                    cluster = {"REDIS_URL": args.redis}
                    modes = {"in-process": ConsoleProcess("uvicorn", work, backends, tag="-local", max_concurrency=1000,
                                                          limited_key=False),
                             "redis-admission": ConsoleProcess("uvicorn", work, backends, tag="-redis", env=cluster,
                                                               max_concurrency=1000, limited_key=False),
                             "redis-no-max-concurrency": ConsoleProcess("uvicorn", work, backends, tag="-redis-none",
                                                                        env=cluster, limited_key=False)}
                    consoles += modes.values()
                    for line in asyncio.run(admission(modes, fast_port, args.scale)):
                        print(line, flush=True)
                    return
                if args.only == "edge":
                    for line in asyncio.run(protocol_cpu(args.scale)):
                        print(line, flush=True)
                    backends = {"fast": fast_port, "fast-rr": fast_port, "tiny": llama_port}
                    consoles += [ConsoleProcess("uvicorn", work, backends, ("--no-head-limits",)),
                                 ConsoleProcess("uvicorn", work, backends)]
                    for line in asyncio.run(head_limits(*consoles, args.scale)):
                        print(line, flush=True)
                    return
                for server in args.servers.split(","):
                    console = ConsoleProcess(server, work, {"fast": fast_port, "fast-rr": fast_port,
                                                            "tiny": llama_port})
                    consoles.append(console)
                    if args.pin:
                        for task in os.listdir(f"/proc/{console.proc.pid}/task"):  # its threads too
                            os.sched_setaffinity(int(task), {1})
                    print(f"{server:8} console calls with {console.key_kind}", flush=True)
                    targets[f"console-{server}"] = (f"{console.url}/v1/chat/completions",
                                                    {**plain, "Authorization": f"Bearer {console.key}"})
                    pids = {"upstream": upstream.pid, "minimal": minimal.pid}
                    if args.only == "all":
                        for line in asyncio.run(measure(server, console, fast_port, llama_port, minimal_port,
                                                        pids, args.scale, floor_port, nginx_port)):
                            print(line, flush=True)
                    if args.only == "streams":
                        for line in asyncio.run(unpaced_streams(server, console, fast_port, minimal_port, pids,
                                                                args.scale)):
                            print(line, flush=True)
                        continue
                    for line in asyncio.run(passthrough(server, console, fast_port, minimal_port, args.scale)):
                        print(line, flush=True)
                gaps = [float(g) for g in args.gaps.split(",") if g.strip()]
                if gaps:
                    for line in asyncio.run(idle_gaps(targets, gaps, args.gap_samples)):
                        print(line, flush=True)
            finally:
                for console in consoles:
                    console.stop()
        finally:
            for proc in procs:
                stop(proc)


if __name__ == "__main__":
    main()
