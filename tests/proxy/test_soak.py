"""Soak: 2,000 proxied requests, 64 at a time, a mix of streaming and not, a tenth of the
streaming clients leaving mid-stream. Zero 5xx from the proxy, and afterwards open file
descriptors, event-loop tasks and upstream connections are back where they started."""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter

import httpx
import pytest

from tests.proxy.conftest import AiohttpBackend

TOTAL = 2000
CONCURRENCY = 64
STREAM_SHARE = 0.5
LEAVE_SHARE = 0.2  # of streams: a tenth of all requests


class SlowStreamBackend(AiohttpBackend):
    """An OpenAI-shaped upstream: JSON answers, and SSE streams of 20 chunks 5 ms apart, so a
    client can leave while the stream is still being produced."""

    def add_routes(self, app) -> None:
        from aiohttp import web

        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            usage = {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}
            if not body.get("stream"):
                return web.json_response({"object": "chat.completion", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                    "usage": usage})
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i in range(20):
                chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(0.005)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response

        app.router.add_post("/v1/chat/completions", chat)


@pytest.fixture(scope="module")
def soak_backend():
    backend = SlowStreamBackend()
    yield backend
    backend.stop()


def _gauges(url: str, headers: dict) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    out = {}
    for name in ("process_open_fds", "xgen_event_loop_tasks"):
        out[name] = float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
    for state in ("idle", "in_use"):
        out[f"upstream_{state}"] = float(re.search(
            rf'^xgen_proxy_upstream_connections\{{state="{state}"\}} (\S+)$', text, re.M).group(1))
    in_flight = re.findall(r"^xgen_inference_in_flight\{.*\} (\S+)$", text, re.M)
    out["in_flight"] = sum(float(v) for v in in_flight)
    return out


async def _run_load(url: str, headers: dict, total: int) -> Counter:
    rng = random.Random(7)
    statuses: Counter = Counter()
    plan = [(rng.random() < STREAM_SHARE, rng.random() < LEAVE_SHARE) for _ in range(total)]
    queue: asyncio.Queue = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=60) as client:

        async def worker() -> None:
            while not queue.empty():
                stream, leave = queue.get_nowait()
                body = {"model": "soak", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
                if not stream:
                    response = await client.post("/v1/chat/completions", json=body)
                    statuses[response.status_code] += 1
                    continue
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    statuses[response.status_code] += 1
                    seen = 0
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            seen += 1
                            if leave and seen == 3:
                                statuses["left"] += 1
                                break  # leaving closes this connection mid-stream

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return statuses


def _settled(url: str, headers: dict, baseline: dict, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        now = _gauges(url, headers)
        same = (now["in_flight"] == 0 and now["upstream_in_use"] == 0
                and now["xgen_event_loop_tasks"] <= baseline["xgen_event_loop_tasks"]
                and now["process_open_fds"] - now["upstream_idle"]
                <= baseline["process_open_fds"] - baseline["upstream_idle"])
        if same or time.monotonic() > deadline:
            return now
        time.sleep(0.25)


def test_soak_2000_requests_no_5xx_no_leaks(proxy_console, soak_backend, capsys):
    console = proxy_console
    console.set_instances([{"name": "soak", "port": soak_backend.port}])
    console.wait_models({"soak"})
    headers = console.auth
    # Warm-up at full concurrency, so pools and lazily created things exist before the baseline.
    warm = asyncio.run(_run_load(console.url, headers, CONCURRENCY * 2))
    assert set(warm) <= {200, "left"}, warm
    baseline = _settled(console.url, headers, _gauges(console.url, headers), timeout=2)

    started = time.monotonic()
    statuses = asyncio.run(_run_load(console.url, headers, TOTAL))
    elapsed = time.monotonic() - started
    after = _settled(console.url, headers, baseline)

    with capsys.disabled():
        print(f"\nsoak: {TOTAL} requests in {elapsed:.1f} s ({TOTAL / elapsed:.0f} req/s), statuses {dict(statuses)}")
        print(f"soak: baseline {baseline}\nsoak: after    {after}")
    assert sum(v for k, v in statuses.items() if k != "left") == TOTAL
    assert statuses[200] == TOTAL, statuses
    assert statuses["left"] > TOTAL * 0.05
    assert after["in_flight"] == 0 and after["upstream_in_use"] == 0, after
    assert after["xgen_event_loop_tasks"] <= baseline["xgen_event_loop_tasks"], (baseline, after)
    assert after["process_open_fds"] - after["upstream_idle"] <= baseline["process_open_fds"] - baseline["upstream_idle"], (baseline, after)
    assert "proxy failed" not in console.console.log
