"""Prefix-aware routing (issue 25 #2): TTFT of chats that share long system prompts, routed by
prefix (XGEN_ROUTING=prefix, the default) against least in flight (the baseline), measured in the
same run on the same engines' settings.

Two consoles (`manage.py serve`, one per routing mode) on throwaway data dirs, each with two
llama-server replicas of one model on the CPU, each replica with --parallel 2 slots (its prompt
cache holds two prompts). Every round uses 4 new system prompts (~1,500 tokens of the tiny model's
vocabulary), so each round starts with cold caches, and asks 10 short user turns under each, the
prompts interleaved, from 2 clients at once (non-streamed, max_tokens 1: the time to the answer is
the time to the first token). Rounds alternate between the two consoles (prefix, least in flight,
prefix, ...) and the medians are compared: least in flight's TTFT p50 over prefix's.

    python bench/prefix_routing.py [--rounds 3] [--model PATH.gguf] [--turns 10] [--slots 2] [--cache-ram MIB]

`--cache-ram 0` turns off llama-server's host-memory prompt cache, so a replica holds only the
prompts in its `--slots` (as a GPU's KV cache holds what its memory allows): with 3 slots a replica
keeps the prompts prefix routing sends it (2 of 4, or 3), where least in flight sends every replica
all 4 in turn and each turn finds its prompt evicted. By default the engine's own cache stays on.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
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

from tests.conftest import start_console  # noqa: E402
from tests.procs import stop_process  # noqa: E402
from tests.serving.conftest import set_console_backends  # noqa: E402

PROMPTS = 4
MODES = ("prefix", "least_inflight")


def system_prompt(round_no: int, n: int, rules: int) -> str:
    return f"Policy {round_no}.{n}: " + " ".join(f"rule {n}-{i} applies to case {i * 7 + n}." for i in range(rules))


def start(tmp: Path, mode: str, model: Path, threads: int, slots: int, cache_ram: int | None) -> tuple:
    console = start_console(tmp / mode, extra_env={"XGEN_RECONCILE_INTERVAL": "1", "XGEN_ROUTING": mode})
    set_console_backends(console)  # the node offers llama-server (as its agent would detect it)
    key = console.manage("createapikey", "--username", "admin").stdout.strip().splitlines()[-1]
    client = httpx.Client(base_url=console.url, headers={"Authorization": f"Bearer {key}"}, timeout=300,
                          trust_env=False)
    try:  # a console that cannot serve the model is stopped here: the caller never holds it
        r = client.post("/api/management/load", json={
            "model_path": str(model), "model_name": "shared", "backend": "llama-server", "replicas": 2,
            "extra_args": {"--ctx-size": 2048 * slots, "--threads": threads, "--parallel": slots,
                           **({} if cache_ram is None else {"--cache-ram": cache_ram})}})
        if r.status_code != 202:
            raise RuntimeError(f"{mode}: the load was refused: {r.status_code} {r.text}")
        deadline = time.monotonic() + 300
        while sum(m["replicas"] for m in client.get("/v1/models").json()["data"] if m["id"] == "shared") < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: never 2 READY replicas")
            time.sleep(0.2)
    except BaseException:
        client.close()
        stop_process(console.proc, timeout=60)
        raise
    return console, client


def one_round(client: httpx.Client, round_no: int, turns: int, rules: int) -> tuple[list[float], int]:
    """TTFTs (s) of PROMPTS x turns chats, and how many prompt tokens the engines reused (cache_n)."""
    jobs = [(p, t) for t in range(turns) for p in range(PROMPTS)]
    systems = [system_prompt(round_no, p, rules) for p in range(PROMPTS)]

    def ask(job: tuple[int, int]) -> tuple[float, int]:
        p, t = job
        t0 = time.perf_counter()
        r = client.post("/v1/chat/completions", json={"model": "shared", "max_tokens": 1, "temperature": 0,
                                                      "messages": [{"role": "system", "content": systems[p]},
                                                                   {"role": "user", "content": f"question {t}"}]})
        r.raise_for_status()
        return time.perf_counter() - t0, (r.json().get("timings") or {}).get("cache_n", 0)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(ask, jobs))
    return [t for t, _ in results], sum(c for _, c in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: the tiny test model)")
    parser.add_argument("--rules", type=int, default=58, help="system prompt length (58: ~1,500 tiny-model tokens)")
    parser.add_argument("--slots", type=int, default=2, help="llama-server --parallel per replica")
    parser.add_argument("--cache-ram", type=int, default=None,
                        help="llama-server --cache-ram MiB (0: prompts cached in the slots only; default: the engine's)")
    args = parser.parse_args()
    from hub.demo import write_tiny_llama_gguf

    cores = os.cpu_count() or 1
    threads = max(1, cores // 2)
    ttfts: dict[str, list[list[float]]] = {m: [] for m in MODES}
    reused: dict[str, list[int]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="xgen-bench-") as tmp:
        model = args.model or write_tiny_llama_gguf(Path(tmp) / "tiny.gguf")
        running = {}
        try:
            for mode in MODES:
                running[mode] = start(Path(tmp), mode, model, threads, args.slots, args.cache_ram)
            for mode in MODES:  # a warm-up round each, not measured (first connections, first batches)
                one_round(running[mode][1], -1, 2, args.rules)
            for round_no in range(args.rounds):
                for mode in MODES:
                    times, cache_n = one_round(running[mode][1], round_no, args.turns, args.rules)
                    ttfts[mode].append(times)
                    reused[mode].append(cache_n)
        finally:
            for console, client in running.values():
                client.close()
                stop_process(console.proc, timeout=60)

    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    print(f"{PROMPTS} system prompts x {args.turns} turns per round (new prompts each round), 2 clients, "
          f"2 llama-server replicas x {args.slots} slots (--cache-ram {'default' if args.cache_ram is None else args.cache_ram}), "
          f"{threads} threads each on {cores} cores, "
          f"{'the tiny GGUF' if args.model is None else args.model.name}; medians of {args.rounds} rounds")
    print(f"{'routing':>15} {'TTFT p50':>9} {'TTFT p90':>9} {'reused tokens/round':>20}")
    p50 = {}
    for mode in MODES:
        p50[mode] = statistics.median(pct(t, 0.5) for t in ttfts[mode]) * 1000
        p90 = statistics.median(pct(t, 0.9) for t in ttfts[mode]) * 1000
        print(f"{mode:>15} {p50[mode]:>7.1f}ms {p90:>7.1f}ms {statistics.median(reused[mode]):>20.0f}")
    print(f"TTFT p50, least_inflight / prefix (the baseline over prefix routing): "
          f"{p50['least_inflight'] / p50['prefix']:.2f}x")


if __name__ == "__main__":
    main()
