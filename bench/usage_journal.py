"""What the usage journal costs on the proxy's hot path: CPU and wall time per recorded request
(UsageRecorder.record, what the proxy calls once an answer ends): the recorder before the journal
(read from git, --baseline, default a0860c9), this one with the journal off, on (one JSON line and
one os.write per request, the default) and on with XGEN_USAGE_JOURNAL_FSYNC (a disk flush per
request), in interleaved rounds of the same run.
The database write every XGEN_USAGE_FLUSH seconds is off the hot path and not counted; between
rounds what was recorded is taken and its journal segments deleted, as a write does.

    python bench/usage_journal.py [--requests N] [--rounds R] [--dir PATH] [--baseline REV]
    python bench/usage_journal.py --proxy [--scale S]

--dir: where the journal goes (default: a temp dir; name a folder on the disk the data dir uses).
--proxy: instead, small chats through two real consoles (uvicorn, bench/proxy_overhead.py's fast
upstream and console setup), XGEN_USAGE_JOURNAL=false and true, in interleaved rounds: req/s and
each console process's CPU per request at c=1, 16 and 64.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
_data = tempfile.mkdtemp(prefix="xgen-bench-journal-")
atexit.register(shutil.rmtree, _data, True)
os.environ.setdefault("XGEN_DATA_DIR", _data)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "xgenconsole.settings")

import django  # noqa: E402

django.setup()

from accounts.credentials import Principal  # noqa: E402
from serving.proxy.usage import RequestContext, UsageRecorder  # noqa: E402
from serving.proxy.usage_journal import UsageJournal  # noqa: E402

KEY = Principal(user_id=3, username="team-lead", role="viewer", key_id=42, key_name="ci pipeline key")


def recorder_at(rev: str) -> UsageRecorder:
    """A UsageRecorder of serving/usage.py as it was at `rev` (a module of its own)."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{rev}:serving/usage.py"], cwd=root, capture_output=True, text=True,
                            check=True).stdout
    # Modules it imports that have moved since (serving/ became planes): their old names, for this module only.
    import serving.node.workers

    sys.modules.setdefault("serving.node.worker", serving.node.workers)
    module = types.ModuleType(f"usage_at_{rev}")
    module.__file__ = f"{rev}:serving/usage.py"
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module.UsageRecorder()


def contexts(n: int) -> list[RequestContext]:
    return [RequestContext(request_id=f"0193a5c8-7d2e-7c41-9a4b-{i:012x}", client="10.20.30.40", principal=KEY,
                           model="smollm2-135m-instruct", stream=i % 2 == 0,
                           client_request_id=f"3f2b7c1e-5a8d-4e6f-9b0c-{i:012x}") for i in range(n)]


def one_round(recorder: UsageRecorder, n: int) -> tuple[float, float]:
    """CPU and wall microseconds per record() over n requests."""
    batch = contexts(n)
    c0, w0 = time.process_time(), time.perf_counter()
    for i, ctx in enumerate(batch):
        recorder.record(ctx, model="smollm2-135m-instruct", instance_id=7, node="gpu-node-01", status=200,
                        error=None, prompt_tokens=31 + i % 50, completion_tokens=64, busy_s=0.0123,
                        ttft_s=0.0456, failed=False, usage_source="engine")
    cpu, wall = (time.process_time() - c0) / n * 1e6, (time.perf_counter() - w0) / n * 1e6
    taken = recorder._take()  # what a write takes; its segments deleted as after a commit
    if isinstance(getattr(recorder, "_journal", None), UsageJournal):
        recorder._journal.committed(taken[-1])
    return cpu, wall


def through_the_proxy(scale: float, rounds: int = 7, *, same: bool = False) -> None:
    """req/s and CPU per request of a console with the journal off and one with it on (`same`:
    both off, the comparison's own noise floor)."""
    import asyncio

    import aiohttp

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import proxy_overhead as po

    work = Path(_data) / "proxy"
    fast_port = po.free_port()
    upstream = subprocess.Popen([sys.executable, po.__file__, "--upstream", str(fast_port)])
    consoles: dict[str, po.ConsoleProcess] = {}
    try:
        po.wait_http(f"http://127.0.0.1:{fast_port}/v1/models", upstream)
        for name, value in (("journal off", "false"), ("journal on", "false" if same else "true")):
            os.environ["XGEN_USAGE_JOURNAL"] = value
            consoles[name] = po.ConsoleProcess("uvicorn", work / name.replace(" ", "-"), {"fast": fast_port})

        async def run() -> None:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                targets = {name: (f"{c.url}/v1/chat/completions",
                                  {"Authorization": f"Bearer {c.key}", "Content-Type": "application/json"})
                           for name, c in consoles.items()}
                for url, headers in targets.values():
                    await po.small_requests(session, url, headers, 300, 8)  # warm both
                for concurrency, n in ((1, 600), (16, 3000), (64, 4000)):
                    n = max(concurrency * 4, int(n * scale)) // rounds * rounds
                    walls, cpus = dict.fromkeys(targets, 0.0), dict.fromkeys(targets, 0.0)
                    ratios = []  # per round: CPU per request on / off (what a shared machine disturbs least)
                    for i in range(rounds):
                        took = {}
                        for name in (list(targets) if i % 2 == 0 else list(targets)[::-1]):
                            url, headers = targets[name]
                            cpu = po.cpu_seconds(consoles[name].proc.pid)
                            _, wall = await po.small_requests(session, url, headers, n // rounds, concurrency)
                            took[name] = po.cpu_seconds(consoles[name].proc.pid) - cpu
                            cpus[name] += took[name]
                            walls[name] += wall
                        ratios.append(took["journal on"] / took["journal off"])
                    off, on = "journal off", "journal on"
                    print(f"c={concurrency:<3} n={n:<5} off {n / walls[off]:6.0f} req/s CPU {1e6 * cpus[off] / n:4.0f} "
                          f"us/req | on {n / walls[on]:6.0f} req/s CPU {1e6 * cpus[on] / n:4.0f} us/req | req/s "
                          f"{walls[off] / walls[on]:.3f}x, CPU {cpus[on] / cpus[off]:.3f}x (rounds' median "
                          f"{statistics.median(ratios):.3f}x, {min(ratios):.2f}-{max(ratios):.2f})", flush=True)

        print(f"small chats through two consoles (uvicorn), {rounds} interleaved rounds each"
              f"{' (--same: the journal off in both, on is the second console)' if same else ''}")
        asyncio.run(run())
    finally:
        for console in consoles.values():
            console.stop()
        po.stop(upstream)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=5000, help="requests recorded per round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dir", type=Path, default=Path(_data) / "usage-journal")
    parser.add_argument("--baseline", default="a0860c9", help="the git revision whose recorder is the baseline")
    parser.add_argument("--proxy", action="store_true", help="req/s through two consoles, journal off and on")
    parser.add_argument("--scale", type=float, default=1.0, help="--proxy: multiply request counts")
    parser.add_argument("--same", action="store_true", help="--proxy with the journal off in both consoles (A/A)")
    args = parser.parse_args()
    if args.proxy:
        through_the_proxy(args.scale, args.rounds, same=args.same)
        return
    fsync_n = max(100, args.requests // 20)  # a disk flush per request: fewer of them
    base = f"before the journal ({args.baseline})"
    variants = {
        base: (recorder_at(args.baseline), args.requests),
        "journal off": (UsageRecorder(), args.requests),
        "journal (default)": (UsageRecorder(journal=UsageJournal(args.dir)), args.requests),
        "journal + fsync": (UsageRecorder(journal=UsageJournal(args.dir, fsync=True)), fsync_n),
    }
    for recorder, n in variants.values():  # warm-up
        one_round(recorder, min(n, 200))
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    wall: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants.items())
        if r % 2:
            order.reverse()
        for name, (recorder, n) in order:
            c, w = one_round(recorder, n)
            cpu[name].append(c)
            wall[name].append(w)
    base_cpu, base_wall = statistics.median(cpu[base]), statistics.median(wall[base])
    print(f"record(): {args.requests} requests a round ({fsync_n} with fsync), {args.rounds} rounds interleaved, "
          f"medians; journal in {args.dir}")
    print(f"{'variant':30} {'CPU us/req':>11} {'x before':>9} {'wall us/req':>12} {'x before':>9}")
    for name in variants:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        print(f"{name:30} {c:11.2f} {c / base_cpu:9.2f} {w:12.2f} {w / base_wall:9.2f}")
    print("(a proxied request costs the console ~450-600 us of CPU: bench/proxy_overhead.py)")


if __name__ == "__main__":
    main()
