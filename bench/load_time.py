"""Load time: the load API call until READY, against starting the same backend by hand, per engine.

Runs a real console (`manage.py serve`) on a throwaway data dir and the tiny GGUF, then, in
the same run and interleaved, starts each engine by hand with the very argv the console's
adapter builds (llama-cpp-python's `python -m llama_cpp.server`, and llama-server). By hand is
timed from Popen to its health answer (`/v1/models`, `/health`) and to the end of the same
warm-up request the console sends; the console from POST /api/management/load to READY
(which includes that warm-up). Prints the medians and ratios side by side.

    python bench/load_time.py [--runs 7] [--engines llama-cpp-python,llama-server]
"""
from __future__ import annotations

import argparse
import contextlib
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

import django  # noqa: E402

django.setup()  # also exports LLAMA_CPP_LIB_PATH when llama-cpp-python needs the cached build's libllama

from hardware.backends import probe_llama_cpp_python, probe_llama_server  # noqa: E402
from serving.adapters import LaunchSpec, get_adapter  # noqa: E402
from tests.conftest import ENGINES, start_console  # noqa: E402
from tests.procs import free_port, stop_process  # noqa: E402

POLL_S = 0.01


def node_backends() -> list[dict]:
    return [probe_llama_cpp_python(), probe_llama_server()]


def console_key(console, backends: list[dict]) -> str:
    """Once the console's own node has registered, give it `backends` (the engines this machine
    has, as the probes report them) and return a new key of its admin."""
    code = ("import json; from hardware.models import Node; "
            f"print(Node.objects.filter(name='test-node').update(backends=json.loads({json.dumps(backends)!r})))")
    deadline = time.monotonic() + 30
    while console.manage("shell", "-v", "0", "-c", code).stdout.strip() != "1":
        if time.monotonic() > deadline:
            raise RuntimeError("the node never registered")
        time.sleep(0.2)
    return console.manage("createapikey", "--username", "admin").stdout.strip().splitlines()[-1]


@contextlib.contextmanager
def started_by_hand(engine: str, row: dict, model: Path, i: int, extra_args: dict | None = None):
    """The backend started as the console would (same argv and environment, plus `extra_args`), by
    hand: yields (client, base URL, spec, adapter, the perf_counter at Popen) once its health path
    answers 200; stopped on leaving."""
    adapter = get_adapter(engine)
    spec = LaunchSpec(model_file=model, model_name=f"hand-{i}", server_type="llm", host="127.0.0.1",
                      port=free_port(), flavour=row["flavour"], version=row["version"], executable=row["path"],
                      extra_args=extra_args or {})
    cmd = adapter.build_command(spec)
    env = adapter.build_env(spec, dict(os.environ))
    base = f"http://127.0.0.1:{spec.port}"
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        with httpx.Client(trust_env=False) as client:
            while True:
                try:
                    if client.get(base + adapter.health_path, timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    raise RuntimeError(f"{engine} exited with {proc.returncode}")
                time.sleep(POLL_S)
            yield client, base, spec, adapter, start
    finally:
        stop_process(proc)


def by_hand(engine: str, row: dict, model: Path, i: int) -> tuple[float, float]:
    """Seconds from Popen until the health path answers 200, and until the warm-up has answered."""
    with started_by_hand(engine, row, model, i) as (client, base, spec, adapter, start):
        healthy = time.perf_counter() - start
        path, body = adapter.warmup_request(spec)
        client.post(base + path, json=body, timeout=120).raise_for_status()
        return healthy, time.perf_counter() - start


def interleaved(model: Path, runs: int, data: Path, engines: list[str]) -> dict[str, dict[str, list[float]]]:
    """Per engine: by hand (health, +warm-up) and through the console, alternating so all see the same load."""
    backends = node_backends()
    rows = {b["name"]: b for b in backends}
    for engine in engines:
        if not rows[engine]["available"]:
            raise SystemExit(f"{engine} is not available here: {rows[engine]['reason']}")
    console = start_console(data)
    try:
        key = console_key(console, backends)
        api = httpx.Client(base_url=f"{console.url}/api/management", headers={"Authorization": f"Bearer {key}"},
                           timeout=10, trust_env=False)
        out = {e: {"health": [], "warm": [], "console": []} for e in engines}
        asked: dict[int, tuple[str, float]] = {}  # instance id: (engine, when its load was posted)
        for i in range(runs):
            for engine in engines:
                healthy, warm = by_hand(engine, rows[engine], model, i)
                out[engine]["health"].append(healthy)
                out[engine]["warm"].append(warm)
                start = time.time()
                r = api.post("/load", json={"model_path": str(model), "model_name": f"bench-{engine}-{i}",
                                            "backend": engine})
                r.raise_for_status()
                iid = r.json()["id"]
                asked[iid] = (engine, start)
                while True:
                    state = api.get(f"/instances/{iid}").json()
                    if state["state"] == "READY":
                        break
                    if state["state"] == "ERROR":
                        raise RuntimeError(state["error"])
                    time.sleep(0.1)  # slow polling: the console shares its loop and these 2 cores with the agent
                # ready_at is stamped by the agent on this machine's clock: no polling delay in the figure.
                out[engine]["console"].append(
                    datetime.fromisoformat(state["ready_at"].replace("Z", "+00:00")).timestamp() - start)
                api.post("/unload", json={"id": iid}).raise_for_status()
                while api.get(f"/instances/{iid}").json()["state"] != "STOPPED":
                    time.sleep(0.1)
        out["phases"] = phases(console, asked)
        return out
    finally:
        stop_process(console.proc, timeout=30)


PHASES = ("PENDING", "CACHING", "LOADING", "WARMING", "READY")


def phases(console, asked: dict[int, tuple[str, float]]) -> dict[str, dict[str, list[float]]]:
    """Where the console's load time goes, per engine: seconds from the load's POST to the row's
    first event (PENDING) and between each state and the next, from the instances' timelines."""
    code = ("import json; from serving.models import InstanceEvent as E; print(json.dumps([(e.instance_id, "
            f"e.to_state, e.at.timestamp()) for e in E.objects.filter(instance_id__in={sorted(asked)!r})"
            ".order_by('at', 'pk')]))")
    rows = json.loads(console.manage("shell", "-v", "0", "-c", code).stdout.strip().splitlines()[-1])
    out: dict[str, dict[str, list[float]]] = {}
    for iid, (engine, posted) in asked.items():
        seen: dict[str, float] = {}
        for row_id, state, at in rows:
            if row_id == iid and state in PHASES and state not in seen:
                seen[state] = at
        marks = [("POST", posted)] + [(state, seen[state]) for state in PHASES if state in seen]
        for (a, t0), (b, t1) in zip(marks, marks[1:], strict=False):
            out.setdefault(engine, {}).setdefault(f"{a}->{b}", []).append(t1 - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--demo", action="store_true", help="the demo chat model (SmolLM2-135M, from its cached "
                                                            "wheel) instead of the tiny GGUF")
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    from hub.demo import write_tiny_llama_gguf

    with tempfile.TemporaryDirectory(prefix="xgen-bench-") as tmp:
        if args.demo:
            from engines import demo_model  # bench/engines.py

            model = demo_model(Path(tmp))
        else:
            model = write_tiny_llama_gguf(Path(tmp) / "tiny.gguf")
        results = interleaved(model, args.runs, Path(tmp) / "console", engines)

    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1000:6.0f} ms"

    print(f"runs: {args.runs} per engine, interleaved, {'the demo model' if args.demo else 'tiny GGUF'}, on the CPU; "
          "medians")
    print(f"{'engine':<18} {'by hand: health':>16} {'by hand: +warm-up':>18} {'console: load->READY':>21}"
          f" {'overhead':>10} {'ratio':>6} {'vs health':>10}")
    phase_times = results.pop("phases")
    for engine, r in results.items():
        h, w, c = (statistics.median(r[k]) for k in ("health", "warm", "console"))
        print(f"{engine:<18} {ms(r['health']):>16} {ms(r['warm']):>18} {ms(r['console']):>21}"
              f" {(c - w) * 1000:+8.0f} ms {c / w:5.2f}x {c / h:9.2f}x")
    print("overhead and ratio: console against by hand with the same warm-up; 'vs health': against health only")
    print("where the console's time goes (medians; the engine's own start and warm-up are in LOADING and WARMING):")
    for engine, steps in phase_times.items():
        print(f"  {engine:<18} " + "  ".join(f"{step} {statistics.median(v) * 1000:.0f} ms" for step, v in steps.items()))


if __name__ == "__main__":
    main()
