"""The node agent's two watchdogs, threads of their own that need nothing of the event loop:

- a stop that ends: from SIGTERM/SIGINT, the agent has XGEN_AGENT_STOP_TIMEOUT_S to drain, stop its
  backends and free the node; past that, every thread's stack goes to its log and the process exits
  1 (stdlib faulthandler's timer, which runs even when the loop and the GIL's holder are stuck). The
  backends it did not stop are adopted or stopped by the next agent (Supervisor.adopt_or_stop_orphans).
- `kill -USR2 <pid>` writes the loop's tasks and what each awaits (`kill -USR1`, every thread's stack);
- a loop that turns: a thread pings the loop every CHECK_S; a loop that has not answered for STALL_S
  is blocked (nothing async runs then: no heartbeat, no stop, no signal handler added with
  loop.add_signal_handler), and its log gets every thread's stack, once per stall.

The signal handler is a plain `signal.signal` one, not the loop's: Python runs it in the main thread
even while the loop is blocked in a call that a signal interrupts, so the stop's deadline is armed
whatever the loop is doing.
"""
from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("xgen.agent")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
TASKS_BEFORE_DEADLINE_S = 2.0  # the loop's tasks are written this long before the deadline's thread stacks


def task_stacks(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """Every task of the loop and what it waits on, down the chain of awaits (a task's own
    get_stack() shows only its outermost frame): where a stop that hangs on a future stands, which
    thread stacks cannot show (the loop is idle in select then)."""
    out = []
    for task in sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name()):
        lines = [f"Task {task.get_name()!r}{' (done)' if task.done() else ''}:"]
        awaited, depth = task.get_coro(), 0
        while awaited is not None and depth < 40:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is None:  # a future, a task, or a finished coroutine
                what = "a future" if type(awaited).__name__ == "FutureIter" else repr(awaited)
                lines.append(f"  waits on {what}"[:300])  # a task it waits on is listed as a task of its own
                break
            lines.append(f"  File \"{frame.f_code.co_filename}\", line {frame.f_lineno} in {frame.f_code.co_name}")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
            depth += 1
        out.append("\n".join(lines))
    return "\n".join(out)


def write_task_stacks(loop: asyncio.AbstractEventLoop) -> None:
    sys.stderr.write(f"node agent: the event loop's tasks:\n{task_stacks(loop)}\n")
    sys.stderr.flush()


def on_stop_signal(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, deadline_s: float) -> None:
    """SIGTERM/SIGINT: set `stop` on the loop, and exit (stacks first) if the stop takes past `deadline_s`."""
    armed: list[bool] = []  # the deadline is armed by the first signal only

    def handler(signum: int, frame) -> None:
        if not armed:
            armed.append(True)
            # Stacks to stderr (the agent's log), then _exit(1): a stop that hangs is seen, never endless.
            faulthandler.dump_traceback_later(deadline_s, exit=True, file=sys.stderr)
            loop.call_soon_threadsafe(loop.call_later, max(0.0, deadline_s - TASKS_BEFORE_DEADLINE_S),
                                      write_task_stacks, loop)
            sys.stderr.write(f"node agent: {signal.Signals(signum).name}: stopping (at most {deadline_s:g} s, "
                             "XGEN_AGENT_STOP_TIMEOUT_S)\n")
        loop.call_soon_threadsafe(stop.set)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def disarm() -> None:
    """The stop ended: the deadline's timer goes (the interpreter's own exit must not trip it)."""
    faulthandler.cancel_dump_traceback_later()


class LoopWatchdog:
    """Logs every thread's stack when the event loop has not turned for STALL_S (once per stall)."""

    CHECK_S = 5.0

    def __init__(self, loop: asyncio.AbstractEventLoop, *, stall_s: float = 30.0,
                 dump: Callable[[], None] | None = None) -> None:
        self.loop = loop
        self.stall_s = stall_s
        self._dump = dump or (lambda: faulthandler.dump_traceback(file=sys.stderr, all_threads=True))
        self._last_tick = time.monotonic()
        self._done = threading.Event()
        self.stalls = 0
        self._thread = threading.Thread(target=self._watch, name="agent-loop-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()

    def _tick(self) -> None:
        self._last_tick = time.monotonic()

    def _watch(self) -> None:
        reported = False
        while not self._done.wait(self.CHECK_S):
            try:
                self.loop.call_soon_threadsafe(self._tick)
            except RuntimeError:  # the loop is closed
                return
            stalled = time.monotonic() - self._last_tick
            if stalled < self.stall_s:
                reported = False
            elif not reported:
                reported = True
                self.stalls += 1
                log.warning("the agent's event loop has not run for %.0f s (blocked): every thread's stack "
                            "follows", stalled)
                self._dump()
