"""Two llama.cpp backends on one CPU (issue 28 #2): what the default threads of a backend that
shares the node's CPU buy. Two llama-server processes of the demo model, started by hand with the
argv the console builds, both asked at once (N concurrent streamed chats each):

- "every core each": the engine's own threads in both (what a backend alone gets, and what both
  got before the console split the cores);
- "cores // 2 each": `--threads cores//2` in both (what the console now gives a backend planned
  beside another: serving/adapters/base.py BackendAdapter.cpu_threads);
- "every core + cores // 2": the first planned alone (every core), the second beside it;
- baseline, in the same run: one backend alone, every core, asked with the same total number of
  chats.

Rounds interleave the three; medians of aggregate tokens/s and TTFT p50.

    python bench/shared_cpu.py [--rounds 3] [--streams 4] [--tokens 64]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "xgenconsole.settings_test")

import django  # noqa: E402

django.setup()

from concurrency import batch  # noqa: E402  (bench/concurrency.py)
from engines import demo_model  # noqa: E402  (bench/engines.py)
from load_time import started_by_hand  # noqa: E402  (bench/load_time.py)

from hardware.backends import probe_llama_server  # noqa: E402


async def both(urls: list[tuple[str, str]], tokens: int, streams: int) -> tuple[float, list[float]]:
    """Aggregate tokens/s and every TTFT with `streams` chats to each backend at once."""
    results = await asyncio.gather(*(batch(f"{base}/v1/chat/completions", {}, model, tokens, streams)
                                     for base, model in urls))
    return sum(rate for rate, _ in results), [t for _, ttfts in results for t in ttfts]


def run(row: dict, model: Path, extras: list[dict], tokens: int, streams: int) -> tuple[float, list[float]]:
    with contextlib.ExitStack() as stack:
        urls = []
        for i, extra in enumerate(extras):
            _, base, spec, _, _ = stack.enter_context(started_by_hand("llama-server", row, model, i, extra))
            urls.append((base, spec.model_name))
        asyncio.run(both(urls, 4, 1))  # warm-up, not measured
        return asyncio.run(both(urls, tokens, streams * 2 // len(extras)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4, help="chats at once to each of the two backends")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    row = probe_llama_server()
    if not row["available"]:
        raise SystemExit(f"llama-server is not available here: {row['reason']}")
    cores = os.cpu_count() or 1
    slots = {"--parallel": args.streams * 2, "--kv-unified": True}
    configs = {
        "one backend alone, every core (baseline)": [slots],
        "two backends, every core each": [slots, slots],
        f"two backends, --threads {max(1, cores // 2)} each": [{**slots, "--threads": max(1, cores // 2)}] * 2,
        f"two, every core + --threads {max(1, cores // 2)}": [slots, {**slots, "--threads": max(1, cores // 2)}],
    }
    results: dict[str, list[tuple[float, list[float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="xgen-bench-") as tmp:
        model = demo_model(Path(tmp))
        for _ in range(args.rounds):
            for name, extras in configs.items():
                results.setdefault(name, []).append(run(row, model, extras, args.tokens, args.streams))
    print(f"demo model, llama-server on {cores} cores, {args.streams * 2} streamed chats in all, {args.tokens} tokens "
          f"each, temperature 0; medians of {args.rounds} interleaved rounds")
    base = statistics.median(r for r, _ in results[next(iter(configs))])
    print(f"{'configuration':<44}{'tok/s':>8}{'vs baseline':>13}{'TTFT p50 ms':>13}")
    for name, runs in results.items():
        rate = statistics.median(r for r, _ in runs)
        ttft = statistics.median(t for _, ts in runs for t in ts)
        print(f"{name:<44}{rate:>8.1f}{rate / base:>12.2f}x{ttft * 1000:>13.0f}")


if __name__ == "__main__":
    main()
