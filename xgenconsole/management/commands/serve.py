"""The all-in-one process: web server and node agent in one process and one event loop."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

log = logging.getLogger("xgen.serve")


class Command(BaseCommand):
    help = "Run the console (web + node agent) in one process: the embedded default."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        # uvicorn is the default: on the proxy's path it adds about half of daphne's latency
        # (bench/proxy_overhead.py), and it hands the body to the app as it arrives.
        parser.add_argument("--server", choices=["daphne", "uvicorn"], default="uvicorn")
        parser.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="asyncio",
                            help="uvicorn's event loop (auto: uvloop when installed); bench/proxy_overhead.py compares them")
        parser.add_argument("--no-agent", action="store_true", help="web only (cluster mode web process)")
        # bench/proxy_overhead.py --only edge: uvicorn's own protocol, to measure what the head limits cost.
        parser.add_argument("--no-head-limits", action="store_true", help=argparse.SUPPRESS)

    def handle(self, *args, host: str, port: int, server: str, no_agent: bool, loop: str = "asyncio",
               no_head_limits: bool = False, **options):
        if not 0 < port < 65536:
            raise CommandError("--port must be 1..65535")
        loop_factory = self._loop_factory(loop) if server == "uvicorn" else None
        flavour = f"{server}, {'uvloop' if loop_factory else 'asyncio'} loop" if server == "uvicorn" else server
        self.stdout.write(f"XGEN Console on http://{host}:{port}/ ({flavour}; node {settings.NODE_NAME})")
        if server == "daphne":
            self.stdout.write("daphne: no request-head deadline, twisted's 16 KiB head cap and no connection cap "
                              "(uvicorn, the default, has XGEN_HEAD_TIMEOUT, XGEN_MAX_HEAD_BYTES, XGEN_MAX_CONNECTIONS)")
        self.stdout.flush()
        if server == "uvicorn":
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                runner.run(self._run_uvicorn(host, port, not no_agent, head_limits=not no_head_limits))
        else:
            self._run_daphne(host, port, not no_agent)

    @staticmethod
    def _loop_factory(choice: str):
        """uvloop's loop factory when asked for (or when installed, for auto), else None (asyncio's)."""
        if choice == "asyncio":
            return None
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise CommandError("--loop uvloop: the uvloop package is not installed") from None
            return None
        return uvloop.new_event_loop

    def _make_agent(self, with_agent: bool):
        if not with_agent:
            return None
        from serving.node.agent import NodeAgent

        return NodeAgent()

    async def _run_uvicorn(self, host: str, port: int, with_agent: bool, *, head_limits: bool = True) -> None:
        import uvicorn

        from xgenconsole.asgi import application
        from xgenconsole.http_edge import guarded_protocol

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                # uvicorn re-raises the signal after serving, which would kill the process
                # before the agent has stopped its backends; we exit normally instead.
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, self.handle_exit, sig, None)
                try:
                    yield
                finally:
                    for sig in (signal.SIGINT, signal.SIGTERM):
                        loop.remove_signal_handler(sig)

            def handle_exit(self, sig: int, frame: object | None) -> None:
                from serving.proxy.ondemand import close_queues

                close_queues()  # what waits in a queue is answered now, not cut off after the grace
                super().handle_exit(sig, frame)

        # httptools with the head deadline, the head size cap and the connection cap (xgenconsole.http_edge).
        http = guarded_protocol(head_timeout_s=settings.HEAD_TIMEOUT_S, max_head_bytes=settings.MAX_HEAD_BYTES,
                                max_connections=settings.MAX_CONNECTIONS) if head_limits else "httptools"
        config = uvicorn.Config(application, host=host, port=port, lifespan="on", log_level="warning", http=http,
                                timeout_graceful_shutdown=settings.SHUTDOWN_GRACE_S)
        web = Server(config)
        agent = self._make_agent(with_agent)
        stop = asyncio.Event()
        agent_task = asyncio.create_task(agent.run(stop)) if agent else None
        try:
            await web.serve()  # returns on SIGINT/SIGTERM (uvicorn installs the handlers)
        finally:
            stop.set()
            if agent_task:
                await agent_task

    def _run_daphne(self, host: str, port: int, with_agent: bool) -> None:
        import daphne.server  # noqa: F401  (installs the asyncio reactor first)
        from daphne.endpoints import build_endpoint_description_strings
        from daphne.server import Server
        from twisted.internet import defer, reactor

        from serving.proxy.upstream import shutdown_proxy
        from xgenconsole.asgi import application
        from xgenconsole.body_guard import install_daphne_guard

        install_daphne_guard()

        agent = self._make_agent(with_agent)
        stop = asyncio.Event()
        state: dict = {}

        def on_ready() -> None:
            if agent:
                state["agent"] = asyncio.ensure_future(agent.run(stop))

                def agent_died(task: asyncio.Future) -> None:
                    if not task.cancelled() and task.exception() is not None:
                        log.error("node agent stopped: %s", task.exception())
                        reactor.callFromThread(reactor.stop)

                state["agent"].add_done_callback(agent_died)

        async def shutdown() -> None:
            stop.set()
            task = state.get("agent")
            if task:
                await asyncio.gather(task, return_exceptions=True)
            await shutdown_proxy()

        reactor.addSystemEventTrigger(
            "before", "shutdown", lambda: defer.Deferred.fromFuture(asyncio.ensure_future(shutdown()))
        )
        Server(
            application=application,
            endpoints=build_endpoint_description_strings(host=host, port=port),
            signal_handlers=True,
            ready_callable=on_ready,
            application_close_timeout=10,
            verbosity=0,
        ).run()
        # SIGTERM arrives as reactor.stop(); keep the default handler for a second signal.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # Daphne does not wait for application instances at shutdown: a websocket still open
        # leaves its consumer's tasks pending, and collecting those at interpreter exit crashed
        # CPython 3.11 (SIGSEGV in GC of a pending Queue.get). Unwind them like asyncio.run().
        loop = asyncio.get_event_loop()
        leftover = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in leftover:
            task.cancel()
        if leftover and not loop.is_closed():
            loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
