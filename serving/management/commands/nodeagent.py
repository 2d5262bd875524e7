"""`manage.py nodeagent`: one per GPU node in cluster mode."""
from __future__ import annotations

import asyncio
import signal

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from serving.node.agent import AgentAlreadyRunning, NodeAgent


class Command(BaseCommand):
    help = "Run the node agent for this node (a file lock keeps it a singleton)."

    def add_arguments(self, parser):
        parser.add_argument("--name", default=None, help=f"node name (default XGEN_NODE_NAME or {settings.NODE_NAME})")
        parser.add_argument("--address", default=None, help="address web processes reach backends on")

    def handle(self, *args, name: str | None, address: str | None, **options):
        agent = NodeAgent(name=name, address=address)

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await agent.run(stop)

        try:
            asyncio.run(main())
        except AgentAlreadyRunning as exc:
            raise CommandError(str(exc)) from None
