"""Cold start: the first token of the first request to an IDLE on_demand model, against starting the
same backend by hand and sending the same request; and what the queue adds at saturation.

Runs a real console (`manage.py serve`) on a throwaway data dir and the tiny GGUF. Interleaved in
the same run:
- by hand: Popen of the very argv the console's adapter builds (llama-cpp-python), poll its health,
  then the streamed chat request; timed from Popen to the first `data:` line;
- the console: a streamed chat request for an IDLE on_demand instance (idle_ttl_s 1, so it is IDLE
  again before the next run); timed from the request to the first `data:` line (the `: loading`
  comments before it do not count).
Then the queue: N concurrent requests to a READY instance with `max_concurrency: 1` against the same
N to one without (the engine serves one at a time either way), mean seconds per request.

    python bench/cold_start.py [--runs 5] [--concurrency 8]
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

django.setup()  # also exports LLAMA_CPP_LIB_PATH when llama-cpp-python needs the cached build's libllama

from hardware.backends import probe_llama_cpp_python, probe_llama_server  # noqa: E402
from tests.conftest import start_console  # noqa: E402
from tests.procs import stop_process  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_time import console_key, started_by_hand  # noqa: E402  (bench/load_time.py: the same start by hand)

ENGINE = "llama-cpp-python"
POLL_S = 0.01
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}


def first_token(client: httpx.Client, url: str, body: dict, headers: dict | None = None) -> float:
    """Seconds until the first `data:` line of a streamed answer (from now)."""
    start = time.perf_counter()
    with client.stream("POST", url, json=body, headers=headers or {}, timeout=300) as r:
        r.raise_for_status()
        elapsed = None
        for line in r.iter_lines():
            if elapsed is None and line.startswith("data: "):
                elapsed = time.perf_counter() - start  # (the rest is read to the end)
    if elapsed is None:
        raise RuntimeError("no data line")
    return elapsed


def by_hand(row: dict, model: Path, i: int) -> float:
    with started_by_hand(ENGINE, row, model, i) as (client, base, _spec, _adapter, start):
        first_token(client, base + "/v1/chat/completions", {"model": f"hand-{i}", **CHAT})
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    from hub.demo import write_tiny_llama_gguf

    backends = [probe_llama_cpp_python(), probe_llama_server()]
    row = next(b for b in backends if b["name"] == ENGINE)
    with tempfile.TemporaryDirectory(prefix="xgen-bench-") as tmp:
        model = write_tiny_llama_gguf(Path(tmp) / "tiny.gguf")
        console = start_console(Path(tmp) / "console", extra_env={
            "XGEN_RECONCILE_INTERVAL": "1", "XGEN_COLD_START_KEEPALIVE_S": "2", "XGEN_USAGE_FLUSH": "1"})
        try:
            key = console_key(console, backends)
            auth = {"Authorization": f"Bearer {key}"}
            client = httpx.Client(base_url=console.url, headers=auth, timeout=30, trust_env=False)

            def load(name: str, **fields) -> int:
                r = client.post("/api/management/load", json={"model_path": str(model), "model_name": name,
                                                              "backend": ENGINE, **fields})
                r.raise_for_status()
                deadline = time.monotonic() + 10
                while name not in {m["id"] for m in client.get("/v1/models").json()["data"]}:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name} never listed")
                    time.sleep(0.02)
                return r.json()["id"]

            def state(pk: int) -> str:
                return client.get(f"/api/management/instances/{pk}").json()["state"]

            cold_id = load("bench-cold", policy="on_demand", idle_ttl_s=1)
            hand, cold = [], []
            for i in range(args.runs):
                hand.append(by_hand(row, model, i))
                while state(cold_id) != "IDLE":
                    time.sleep(0.1)
                time.sleep(0.5)  # the routing table shows it idle
                cold.append(first_token(client, "/v1/chat/completions", {"model": "bench-cold", **CHAT}))

            # The queue at saturation: the same N requests, with and without max_concurrency 1.
            queued_id = load("bench-queued", max_concurrency=1)
            free_id = load("bench-free")
            for pk in (queued_id, free_id):
                while state(pk) != "READY":
                    time.sleep(0.1)

            def batch(name: str) -> float:
                body = {"model": name, **CHAT, "stream": False}
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                    list(pool.map(lambda _: client.post("/v1/chat/completions", json=body, timeout=300)
                                  .raise_for_status(), range(args.concurrency)))
                return (time.perf_counter() - start) / args.concurrency

            queued, free = [], []
            for _ in range(args.runs):
                free.append(batch("bench-free"))
                queued.append(batch("bench-queued"))
        finally:
            stop_process(console.proc, timeout=60)

    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1000:7.0f} ms"

    h, c = statistics.median(hand), statistics.median(cold)
    print(f"runs: {args.runs}, tiny GGUF, {ENGINE} on the CPU; medians")
    print(f"first token, by hand (Popen -> health -> request): {ms(hand)}")
    print(f"first token, console (request to an IDLE model):   {ms(cold)}   {(c - h) * 1000:+.0f} ms, {c / h:.2f}x")
    q, f = statistics.median(queued), statistics.median(free)
    print(f"{args.concurrency} concurrent requests, per request: no limit {ms(free)}, max_concurrency 1 {ms(queued)}"
          f"   {(q - f) * 1000:+.1f} ms, {q / f:.2f}x")


if __name__ == "__main__":
    main()
