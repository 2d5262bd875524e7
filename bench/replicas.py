"""Replicas (issue 30): aggregate generated tokens/s and TTFT p50/p90 of N concurrent streamed chats
with 1 and 2 replicas of a model behind the console, against the same engines started by hand
behind a minimal round-robin proxy, measured in the same run.

Runs a real console (`manage.py serve`) on a throwaway data dir and the tiny GGUF, llama-server on
the CPU. Each replica gets cores / replicas threads (the replicas share the cores fairly) and one
slot; by hand: the same llama-server flags, and an aiohttp proxy in its own process that sends
each request to the next engine in turn. Rounds are interleaved (console, by hand, console, ...)
and the medians compared: the console's aggregate tokens/s as a share of the by-hand figure.

    python bench/replicas.py [--rounds 3] [--concurrency 8] [--streams 32] [--tokens 64]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "xgenconsole.settings_test")

import django  # noqa: E402

django.setup()

from hardware.backends import probe_llama_cpp_python, probe_llama_server  # noqa: E402
from tests.conftest import engine_command, start_console  # noqa: E402
from tests.procs import stop_process  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_time import console_key  # noqa: E402  (bench/load_time.py)
from proxy_overhead import free_port, stop, wait_http  # noqa: E402  (bench/proxy_overhead.py)

CTX = 4096
PARALLEL = 8  # slots per engine, one per concurrent stream (the context is shared among them)


def run_round_robin_proxy(port: int, upstream_ports: list[int]) -> None:
    """A minimal round-robin proxy: one pooled aiohttp client, the next engine for each request,
    bytes passed through as they come."""
    import itertools

    import aiohttp
    from aiohttp import web

    turn = itertools.cycle(upstream_ports)

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with request.app["session"].post(f"http://127.0.0.1:{next(turn)}{request.path}", data=body,
                                               headers={"Content-Type": "application/json"}) as upstream:
            response = web.StreamResponse(status=upstream.status,
                                          headers={"Content-Type": upstream.headers.get("Content-Type", "")})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def start(app: web.Application) -> None:
        # A connection per request: llama-server closes kept-alive connections now and then, and
        # aiohttp would answer the request that met one with a 500.
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))

    async def close(app: web.Application) -> None:
        await app["session"].close()

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(close)
    app.router.add_post("/v1/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


async def streamed_chats(url: str, headers: dict, model: str, *, n: int, concurrency: int, tokens: int
                         ) -> tuple[float, list[float], list[tuple[float, float]]]:
    """(generated tokens/s over the batch, TTFTs in s, the console's Server-Timing (its own ms, the
    backend's first byte in ms) where the answer has one) of `n` streamed chats at `concurrency`."""
    import aiohttp

    body = json.dumps({"model": model, "stream": True, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": "tell me a story"}]}).encode()
    ttfts: list[float] = []
    timings: list[tuple[float, float]] = []
    generated = 0
    left = n

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal left, generated
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            first = None
            async with session.post(url, data=body, headers={**headers, "Content-Type": "application/json"}) as r:
                assert r.status == 200, (r.status, await r.text())
                parts = dict(p.strip().split(";dur=") for p in r.headers.get("server-timing", "").split(",") if ";dur=" in p)
                if "upstream" in parts:
                    timings.append((float(parts["proxy"]), float(parts["upstream"])))
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    if b'"content"' in line:
                        if first is None:
                            first = time.perf_counter() - t0
                        generated += 1
            ttfts.append(first if first is not None else time.perf_counter() - t0)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return generated / wall, ttfts, timings


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from hub.demo import write_tiny_llama_gguf

    cores = os.cpu_count() or 1
    backends = [probe_llama_cpp_python(), probe_llama_server()]
    results: dict[tuple[str, int], list[tuple[float, list[float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="xgen-bench-") as tmp:
        model = write_tiny_llama_gguf(Path(tmp) / "tiny.gguf")
        console = start_console(Path(tmp) / "console", extra_env={"XGEN_RECONCILE_INTERVAL": "1"})
        client = None
        try:
            key = console_key(console, backends)
            auth = {"Authorization": f"Bearer {key}"}
            client = httpx.Client(base_url=console.url, headers=auth, timeout=60, trust_env=False)
            for replicas in (1, 2):
                threads = max(1, cores // replicas)
                name = f"bench-r{replicas}"
                r = client.post("/api/management/load", json={
                    "model_path": str(model), "model_name": name, "backend": "llama-server", "replicas": replicas,
                    "extra_args": {"--ctx-size": CTX, "--threads": threads, "--parallel": PARALLEL}})
                r.raise_for_status()
                deadline = time.monotonic() + 120
                while sum(m["replicas"] for m in client.get("/v1/models").json()["data"] if m["id"] == name) < replicas:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name} never had {replicas} READY replicas")
                    time.sleep(0.1)
                engines: list[subprocess.Popen] = []
                ports = [free_port() for _ in range(replicas)]
                for port in ports:
                    cmd, health = engine_command("llama-server", model=model, port=port, alias=name, n_ctx=CTX)
                    proc = subprocess.Popen([*cmd, "--threads", str(threads), "--parallel", str(PARALLEL)], stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
                    engines.append(proc)
                    wait_http(f"http://127.0.0.1:{port}{health}", proc)
                proxy_port = free_port()
                proxy = multiprocessing.Process(target=run_round_robin_proxy, args=(proxy_port, ports), daemon=True)
                proxy.start()
                time.sleep(1.0)
                try:
                    for _ in range(args.rounds):
                        for who, url, headers in (("console", f"{console.url}/v1/chat/completions", auth),
                                                  ("by hand", f"http://127.0.0.1:{proxy_port}/v1/chat/completions",
                                                   {})):
                            # Warm-up, not measured: each side's first connections stay out of the timing
                            # (the console's relay reuses a pooled connection idle at most 4 s, under
                            # llama-server's 5 s keep-alive: serving/proxy/http1.py KEEPALIVE_S).
                            with contextlib.suppress(AssertionError, OSError):
                                asyncio.run(streamed_chats(url, headers, name, n=args.concurrency,
                                                           concurrency=args.concurrency, tokens=4))
                            results.setdefault((who, replicas), []).append(asyncio.run(streamed_chats(
                                url, headers, name, n=args.streams, concurrency=args.concurrency,
                                tokens=args.tokens)))
                finally:
                    proxy.terminate()
                    for proc in engines:
                        stop(proc)
                    client.post("/api/management/unload", json={"model_name": name})
                    time.sleep(2)
        except BaseException:
            logs = sorted((Path(tmp) / "console").rglob("current.log"))
            for path in logs:
                print(f"--- {path}:\n" + "\n".join(line for line in path.read_text(errors="replace").splitlines()[-400:] if not (" slot " in line or "slot " in line[:40])))
            print("--- console:\n" + console.log[-3000:])
            print(console.manage("shell", "-v", "0", "-c", "from serving.models import InstanceEvent as E; "
                                 "print([(e.instance_id, e.to_state, e.message[:150]) for e in E.objects.all()])").stdout)
            raise
        finally:
            if client is not None:
                client.close()
            stop_process(console.proc, timeout=60)

    print(f"{args.concurrency} concurrent streamed chats, {args.streams} per round, {args.tokens} tokens each, "
          f"llama-server on {cores} cores (threads = cores / replicas), tiny GGUF; medians of {args.rounds} rounds")
    print(f"{'replicas':>8} {'who':>8} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p90':>9}")
    for replicas in (1, 2):
        figures = {}
        for who in ("console", "by hand"):
            runs = results[(who, replicas)]
            rate = statistics.median(r for r, _, _ in runs)
            p50 = statistics.median(pct(t, 0.5) for _, t, _ in runs) * 1000
            p90 = statistics.median(pct(t, 0.9) for _, t, _ in runs) * 1000
            figures[who] = rate
            timed = [t for _, _, ts in runs for t in ts]
            split = (f"   the console's own time p50 {statistics.median(p for p, _ in timed):.1f} ms, the backend's first "
                     f"byte p50 {statistics.median(u for _, u in timed):.1f} ms (Server-Timing)") if timed else ""
            print(f"{replicas:>8} {who:>8} {rate:>9.1f} {p50:>7.0f}ms {p90:>7.0f}ms{split}")
        print(f"{'':>8} console / by hand: {figures['console'] / figures['by hand']:.1%}")


if __name__ == "__main__":
    main()
