"""Load time: the load API call until READY, against starting the same backend by hand.

Runs a real console (`manage.py serve`) on a throwaway data dir and the tiny GGUF, then, in
the same run, starts `python -m llama_cpp.server` by hand with the same flags. Prints the
median of each, the console's overhead in ms and as a ratio.

    python bench/load_time.py [--runs 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "xgenconsole.settings_test")

from tests.conftest import start_console  # noqa: E402
from tests.procs import free_port, stop_process  # noqa: E402

POLL_S = 0.01
BACKENDS = [{"name": "llama-cpp-python", "available": True, "version": "", "flavour": "cpu", "path": "", "reason": ""}]


def by_hand(model: Path, i: int) -> float:
    """Seconds from Popen until /v1/models answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", f"hand-{i}",
           "--host", "127.0.0.1", "--port", str(port)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {proc.returncode}")
            time.sleep(POLL_S)
        return time.perf_counter() - start
    finally:
        stop_process(proc)


def interleaved(model: Path, runs: int, data: Path) -> tuple[list[float], list[float]]:
    """(by hand, through the console) seconds, alternating so both see the same machine load.

    Console: from POST /api/management/load until the instance is READY (warm-up included).
    """
    console = start_console(data)
    try:
        code = ("import json; from hardware.models import Node; "
                f"print(Node.objects.filter(name='test-node').update(backends=json.loads({json.dumps(BACKENDS)!r})))")
        deadline = time.monotonic() + 30
        while console.manage("shell", "-v", "0", "-c", code).stdout.strip() != "1":
            if time.monotonic() > deadline:
                raise RuntimeError("the node never registered")
            time.sleep(0.2)
        key = console.manage("createapikey", "--username", "admin").stdout.strip()
        api = httpx.Client(base_url=f"{console.url}/api/management", headers={"Authorization": f"Bearer {key}"},
                           timeout=10, trust_env=False)
        times, hand = [], []
        for i in range(runs):
            hand.append(by_hand(model, i))
            start = time.time()
            r = api.post("/load", json={"model_path": str(model), "model_name": f"bench-{i}"})
            r.raise_for_status()
            iid = r.json()["id"]
            while True:
                state = api.get(f"/instances/{iid}").json()
                if state["state"] == "READY":
                    break
                if state["state"] == "ERROR":
                    raise RuntimeError(state["error"])
                time.sleep(0.1)  # slow polling: the console shares its loop and these 2 cores with the agent
            # ready_at is stamped by the agent on this machine's clock: no polling delay in the figure.
            times.append(datetime.fromisoformat(state["ready_at"].replace("Z", "+00:00")).timestamp() - start)
            api.post("/unload", json={"id": iid}).raise_for_status()
            while api.get(f"/instances/{iid}").json()["state"] != "STOPPED":
                time.sleep(0.1)
        return hand, times
    finally:
        stop_process(console.proc, timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    from hub.demo import write_tiny_llama_gguf

    with tempfile.TemporaryDirectory(prefix="xgen-bench-") as tmp:
        model = write_tiny_llama_gguf(Path(tmp) / "tiny.gguf")
        hand, console = interleaved(model, args.runs, Path(tmp) / "console")
    h, c = statistics.median(hand), statistics.median(console)
    print(f"runs: {args.runs} each, interleaved, tiny GGUF, llama-cpp-python on the CPU")
    print(f"by hand, Popen -> /v1/models 200:      median {h * 1000:7.0f} ms  (min {min(hand) * 1000:.0f}, max {max(hand) * 1000:.0f})")
    print(f"console, load API -> READY (+warm-up): median {c * 1000:7.0f} ms  (min {min(console) * 1000:.0f}, max {max(console) * 1000:.0f})")
    print(f"console overhead: {(c - h) * 1000:+.0f} ms, ratio {c / h:.2f}x")


if __name__ == "__main__":
    main()
