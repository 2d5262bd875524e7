"""Many users at once on the demo model (issue 28 #2): 1, 4 and 16 concurrent streamed chats,
aggregate tokens/s and TTFT p50/p90, for llama-server

- started by hand with each slot count of a sweep (`--parallel` 1, 4 = llama-server's own auto
  choice, 8, 16; `--kv-unified` so each slot keeps the whole context), the best of which is the
  baseline of the defaults;
- loaded through the console with no extra_args (the console's defaults, serving/adapters/
  llama_server.py DEFAULT_SLOTS), asked through the console's /v1 with a key: the console adds
  auth, limits, usage and the request log; its figure is printed beside the same argv by hand.

Rounds interleave the configurations; medians. Temperature 0, the same prompt for all.

    python bench/concurrency.py [--rounds 2] [--tokens 96]
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

django.setup()

import httpx  # noqa: E402
from engines import PROMPT, demo_model  # noqa: E402  (bench/engines.py)
from load_time import console_key, started_by_hand  # noqa: E402  (bench/load_time.py)
from replicas import pct  # noqa: E402  (bench/replicas.py)

from hardware.backends import probe_llama_cpp_python, probe_llama_server  # noqa: E402
from tests.conftest import start_console  # noqa: E402
from tests.procs import stop_process  # noqa: E402

LEVELS = (1, 4, 16)
SWEEP = (1, 4, 8, 16)


async def batch(url: str, headers: dict, model: str, tokens: int, concurrency: int) -> tuple[float, list[float]]:
    """(aggregate content chunks/s, TTFTs in s) of `concurrency` streamed chats started together."""
    import aiohttp

    body = json.dumps({"model": model, "stream": True, "max_tokens": tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": PROMPT}]}).encode()

    async def one(session: aiohttp.ClientSession) -> tuple[float, int]:
        t0 = time.perf_counter()
        first, n = None, 0
        async with session.post(url, data=body, headers={**headers, "Content-Type": "application/json"}) as r:
            assert r.status == 200, (r.status, await r.text())
            async for line in r.content:
                if line.startswith(b"data: {") and b'"content":"' in line:
                    first = first if first is not None else time.perf_counter() - t0
                    n += 1
        return (first if first is not None else time.perf_counter() - t0), n

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(session) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return sum(n for _, n in results) / wall, [t for t, _ in results]


def measure(url: str, headers: dict, model: str, tokens: int, into: dict) -> None:
    asyncio.run(batch(url, headers, model, 4, 2))  # warm-up, not measured
    for level in LEVELS:
        rate, ttfts = asyncio.run(batch(url, headers, model, tokens, level))
        into.setdefault(level, []).append((rate, ttfts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    row = probe_llama_server()
    if not row["available"]:
        raise SystemExit(f"llama-server is not available here: {row['reason']}")
    results: dict[str, dict[int, list]] = {}
    with tempfile.TemporaryDirectory(prefix="xgen-bench-") as tmp:
        model = demo_model(Path(tmp))
        console = start_console(Path(tmp) / "console")
        try:
            backends = [probe_llama_cpp_python(), row]
            key = console_key(console, backends)
            auth = {"Authorization": f"Bearer {key}"}
            with httpx.Client(base_url=console.url, headers=auth, timeout=60, trust_env=False) as client:
                r = client.post("/api/management/load", json={"model_path": str(model), "model_name": "demo",
                                                              "backend": "llama-server", "preset": "none"})
                r.raise_for_status()
                deadline = time.monotonic() + 120
                while (inst := client.get(f"/api/management/instances/{r.json()['id']}").json())["state"] != "READY":
                    if time.monotonic() > deadline or inst["state"] == "ERROR":
                        raise RuntimeError(f"the demo model did not load: {inst}")
                    time.sleep(0.2)
                console_argv = inst["command"]
                for _ in range(args.rounds):
                    measure(f"{console.url}/v1/chat/completions", auth, "demo", args.tokens,
                            results.setdefault("console (its defaults)", {}))
                    for slots in SWEEP:
                        with started_by_hand("llama-server", row, model, slots,
                                             {"--parallel": slots, "--kv-unified": True}) as (_, base, spec, _, _):
                            measure(f"{base}/v1/chat/completions", {}, spec.model_name, args.tokens,
                                    results.setdefault(f"by hand, --parallel {slots}", {}))
        finally:
            stop_process(console.proc, timeout=60)

    print(f"demo model (SmolLM2-135M-Instruct Q4_1), llama-server on {os.cpu_count()} cores, {args.tokens} tokens "
          f"per chat, temperature 0; medians of {args.rounds} rounds")
    print("the console's argv: " + " ".join(a for a in console_argv[3:] if not a.startswith("/")))
    rates = {who: {lv: statistics.median(r for r, _ in runs) for lv, runs in by.items()} for who, by in results.items()}
    best = max((w for w in rates if w.startswith("by hand")), key=lambda w: rates[w][16])
    same = f"by hand, --parallel {console_argv[console_argv.index('--parallel') + 1]}" \
        if "--parallel" in console_argv else best
    print(f"{'configuration':<28}" + "".join(f"{f'c={lv} tok/s':>12}{'TTFT p50/p90 ms':>18}" for lv in LEVELS))
    for who, by in results.items():
        cells = ""
        for lv in LEVELS:
            ttfts = [t for _, ts in by[lv] for t in ts]
            cells += f"{rates[who][lv]:>12.1f}{f'{pct(ttfts, .5) * 1000:.0f}/{pct(ttfts, .9) * 1000:.0f}':>18}"
        print(f"{who:<28}{cells}")
    print(f"the best by hand at 16 streams: {best}")
    print(f"the console's defaults / the best by hand, 16 streams: {rates['console (its defaults)'][16] / rates[best][16]:.2f}x")
    for lv in LEVELS:
        print(f"the console / the same argv by hand ({same}), {lv} streams: "
              f"{rates['console (its defaults)'][lv] / rates[same][lv]:.3f}x")


if __name__ == "__main__":
    main()
