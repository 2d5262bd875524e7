"""The node agent's watchdogs (serving.node.watchdog) in processes of their own: a stop that hangs
ends at its deadline with every thread's stack in the log (exit 1), also when the event loop itself
is blocked (the signal handler is Python's, not the loop's); a stop that ends in time exits 0 and
the disarmed timer never fires; a blocked loop is reported once, with stacks."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from serving.node.watchdog import LoopWatchdog
from tests.conftest import REPO

SCRIPT = textwrap.dedent("""
    import asyncio, sys, time
    from serving.node.watchdog import disarm, on_stop_signal

    async def main(mode):
        stop = asyncio.Event()
        on_stop_signal(asyncio.get_running_loop(), stop, 2.0)
        print("ready", flush=True)
        if mode == "blocked":
            time.sleep(60)  # the loop itself is blocked: no asyncio signal handler could run
        await stop.wait()
        print("stopping", flush=True)
        if mode == "hang":
            await asyncio.Event().wait()  # a stop that never ends
        await asyncio.sleep(0.5)  # "clean": a stop of 0.5 s

    mode = sys.argv[1]
    try:
        asyncio.run(main(mode))
    finally:
        disarm()
    if mode == "clean":
        time.sleep(3)  # after the stop: a timer left armed would fire here (2 s after the signal)
    print("exited cleanly", flush=True)
""")


def _run(mode: str) -> tuple[int, str, float]:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout.readline().strip() == "ready"
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{mode}: the process did not end within 30 s of SIGTERM:\n{out}")
    return proc.returncode, out, time.monotonic() - sent


@pytest.mark.parametrize("mode", ["hang", "blocked"])
def test_a_stop_that_hangs_ends_at_its_deadline_with_every_threads_stack(mode):
    code, out, took = _run(mode)
    assert code == 1, out
    assert "SIGTERM: stopping (at most 2 s, XGEN_AGENT_STOP_TIMEOUT_S)" in out
    assert "Timeout (0:00:02)!" in out and "Thread 0x" in out, out  # faulthandler's dump
    assert "exited cleanly" not in out
    if mode == "hang":  # the loop runs: its tasks, down to the await that hangs, come before the threads
        line = next(n for n, text in enumerate(SCRIPT.splitlines(), 1) if "asyncio.Event().wait()" in text)
        tasks = out.split("node agent: the event loop's tasks:\n", 1)[1].split("Timeout (0:00:02)!")[0]
        assert f'line {line} in main\n' in tasks and "in wait\n  waits on a future" in tasks, out
        assert "stopping" in out.splitlines()
    else:  # the loop never turned: the stop was never seen by it, the deadline ended it anyway
        line = next(n for n, text in enumerate(SCRIPT.splitlines(), 1) if "time.sleep(60)" in text)
        assert "stopping" not in out.splitlines() and f"line {line} in main" in out, out
    assert took >= 2


def test_a_stop_that_ends_in_time_exits_0_and_leaves_no_timer():
    code, out, _ = _run("clean")
    assert code == 0, out
    assert "exited cleanly" in out and "Timeout" not in out


async def test_a_blocked_loop_is_reported_once_per_stall_with_stacks():
    dumps: list[float] = []
    watchdog = LoopWatchdog(asyncio.get_running_loop(), stall_s=0.5, dump=lambda: dumps.append(time.monotonic()))
    watchdog.CHECK_S = 0.1
    watchdog.start()
    try:
        await asyncio.sleep(0.5)
        assert watchdog.stalls == 0  # a loop that turns is never reported
        time.sleep(1.5)  # blocked
        await asyncio.sleep(0.5)  # turns again
        assert watchdog.stalls == 1 and len(dumps) == 1
        time.sleep(1.5)  # a second stall
        await asyncio.sleep(0.3)
        assert watchdog.stalls == 2 and len(dumps) == 2
    finally:
        watchdog.stop()
