"""`manage.py nodeagent`: one per GPU node in cluster mode."""
from __future__ import annotations

import asyncio
import faulthandler
import signal

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from serving.node.agent import AGENT_REFUSED, NodeAgent
from serving.node.watchdog import LoopWatchdog, disarm, on_stop_signal, write_task_stacks


class Command(BaseCommand):
    help = ("Run the node agent for this node (one per node name: a second one, while the first beats "
            "heartbeats, is refused).")
    # Django's system checks import every URLconf and the whole web API, which this command never
    # serves (1.4 s a start); `manage.py check` and `manage.py serve` still run them.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser):
        parser.add_argument("--name", default=None, help=f"node name (default XGEN_NODE_NAME or {settings.NODE_NAME})")
        parser.add_argument("--address", default=None, help="address web processes reach backends on")

    def handle(self, *args, name: str | None, address: str | None, **options):
        # `kill -USR1 <pid>` writes every thread's stack to the agent's stderr (its log): what a
        # hung agent waits on, without stopping it (stdlib faulthandler, no debugger needed); a
        # fatal signal (a crash in a native library) writes them too before the agent dies.
        faulthandler.enable(all_threads=True)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        agent = NodeAgent(name=name, address=address)

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            on_stop_signal(loop, stop, settings.AGENT_STOP_TIMEOUT_S)
            loop.add_signal_handler(signal.SIGUSR2, write_task_stacks, loop)  # what each task awaits
            watchdog = LoopWatchdog(loop)
            watchdog.start()
            try:
                await agent.run(stop)
            finally:
                watchdog.stop()

        try:
            asyncio.run(main())
        except AGENT_REFUSED as exc:  # another agent has this node: exit 1 saying which
            raise CommandError(str(exc)) from None
        finally:
            disarm()
