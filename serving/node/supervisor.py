"""The supervisor: the node agent's worker that owns backend processes on its node.

Controller pattern: the database holds each instance's desired state; `reconcile()` makes
the processes match (a nudge runs it at once, and it runs every RECONCILE_INTERVAL_S).

One instance, one `BackendRun`: its lifecycle task walks PENDING -> CACHING -> LOADING ->
WARMING -> READY, then watches the process; a crash of a READY backend goes to ERROR and is
restarted with exponential backoff. Process work (spawning into its own session with its log
file, killing the group) is serving.node.processes; following the log file into the page, the
log tail in the database and the ready hint is serving.node.logs.LogTailer.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from serving import events
from serving.adapters import BackendAdapter, LaunchSpec, get_adapter
from serving.models import ACTIVE_STATES, DesiredState, InstanceState, ModelInstance
from serving.node.logs import TAIL_POLL_S, LogTailer, current_log, previous_log
from serving.node.processes import (
    BackendProcess,
    bind_host,
    describe_exit,
    listener_is_ours,
    pid_alive,
    proc_cmdline,
    spawn_backend,
    url_host,
)
from serving.node.worker import AgentWorker
from serving.placement import PlacementError, pick_port
from serving.selection import choose_backend, node_gpu_type
from serving.services import gguf_in_dir, save_log_tail, transition

if TYPE_CHECKING:
    from serving.node.agent import NodeAgent

log = logging.getLogger("xgen.supervisor")

HEALTH_POLL_S = 0.25
HEALTH_POLL_FAST_S = 0.05  # for the first seconds: small models are up in well under one
FAST_POLL_FOR_S = 10
WARMUP_TIMEOUT_S = 120

LOADED, LOAD_FAILED, CRASHED, STOPPED = "loaded", "load_failed", "crashed", "stopped"


class LoadFailed(Exception):
    """The backend could not be started or did not become ready (message for the page)."""


def _db(fn):
    """Run a DB function off the loop, with stale connections closed first."""

    def call(*args, **kwargs):
        close_old_connections()
        return fn(*args, **kwargs)

    return sync_to_async(call)


db_transition = _db(transition)
db_save_tail = _db(save_log_tail)


def _get(instance_id: int) -> ModelInstance | None:
    return ModelInstance.objects.select_related("node").filter(pk=instance_id).first()


db_get = _db(_get)


@dataclass
class BackendRun:
    """One instance's process on this node, as far as the supervisor knows it."""

    instance_id: int
    adapter: BackendAdapter | None = None
    model_name: str = ""
    server_type: str = "llm"
    port: int | None = None
    process: BackendProcess | None = None
    adopted: bool = False
    stopping: bool = False
    spec: LaunchSpec | None = None
    tailer: LogTailer | None = None
    lifecycle: asyncio.Task | None = None
    stopper: asyncio.Task | None = None

    def last_lines(self, n: int = 12) -> str:
        return self.tailer.last_lines(n) if self.tailer else ""

    @property
    def tail(self) -> list[str]:
        return list(self.tailer.tail) if self.tailer else []

    def exited(self) -> bool:
        return self.process is None or self.process.exited()


class Supervisor(AgentWorker):
    """Starts, watches and stops the backend processes of this node's instances."""

    name = "supervisor"

    def __init__(self) -> None:
        self.runs: dict[int, BackendRun] = {}
        self.http: httpx.AsyncClient | None = None
        self.agent: NodeAgent | None = None

    # ------------------------------------------------------------ agent hooks
    async def start(self, agent: NodeAgent) -> None:
        self.agent = agent
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=2.0), trust_env=False)
        await self.adopt_or_stop_orphans()
        await self.reconcile()
        # Autostart instances are part of a started agent: wait until each settles.
        autostart = await _db(lambda: set(ModelInstance.objects.filter(
            node__name=agent.name, autostart=True, desired_state=DesiredState.RUNNING).values_list("pk", flat=True)))()
        waits = [self._settled(r) for pk, r in self.runs.items() if pk in autostart]
        if waits:
            await asyncio.gather(*waits)

    async def run(self, agent: NodeAgent) -> None:
        while True:
            try:
                await self.reconcile()
            except Exception:
                log.exception("reconcile failed; retrying")
            await agent.wait_for_nudge(settings.RECONCILE_INTERVAL_S)

    async def stop(self, agent: NodeAgent) -> None:
        await asyncio.gather(
            *(self.stop_instance(pk, "node agent stopped", keep_desired=True) for pk in list(self.runs)),
            return_exceptions=True,
        )
        if self.http is not None:
            await self.http.aclose()

    async def _settled(self, run: BackendRun) -> None:
        deadline = time.monotonic() + (run.adapter.load_timeout_s() if run.adapter else 60) + 30
        while time.monotonic() < deadline and run.lifecycle and not run.lifecycle.done():
            inst = await db_get(run.instance_id)
            if inst is None or inst.state in (InstanceState.READY, InstanceState.ERROR, InstanceState.STOPPED):
                return
            await asyncio.sleep(0.2)

    # ------------------------------------------------------------ reconcile
    def _instances(self) -> list[ModelInstance]:
        from serving.services import instances_for_node

        return instances_for_node(self.agent.name)

    async def reconcile(self) -> None:
        """Make this node's processes match the desired state in the database."""
        instances = await _db(self._instances)()
        seen = set()
        for inst in instances:
            seen.add(inst.pk)
            run = self.runs.get(inst.pk)
            if run is not None and run.stopper is not None:
                continue  # being stopped
            if inst.desired_state == DesiredState.STOPPED:
                if run is not None:
                    run.stopper = asyncio.create_task(self.stop_instance(inst.pk, "unload requested"))
                elif inst.state in ACTIVE_STATES:
                    await db_transition(inst.pk, InstanceState.STOPPED, "unloaded", gpus=[], port=None, pid=None,
                                        pgid=None, stopped_at=timezone.now(), progress_pct=None)
                continue
            if run is not None and inst.restart_requested:
                run.stopper = asyncio.create_task(self._restart(inst.pk))
                continue
            if run is None and inst.state != InstanceState.ERROR:
                if inst.restart_requested:
                    await _db(lambda pk=inst.pk: ModelInstance.objects.filter(pk=pk).update(restart_requested=False))()
                self._launch(inst)
        for pk in [pk for pk in self.runs if pk not in seen]:  # row deleted under a running backend
            run = self.runs[pk]
            if run.stopper is None:
                run.stopper = asyncio.create_task(self.stop_instance(pk, "instance deleted"))

    async def _restart(self, instance_id: int) -> None:
        await _db(lambda: ModelInstance.objects.filter(pk=instance_id).update(restart_requested=False))()
        await self.stop_instance(instance_id, "restart requested", keep_desired=True)
        inst = await db_get(instance_id)
        if inst is not None and inst.desired_state == DesiredState.RUNNING:
            inst = await db_transition(instance_id, InstanceState.PENDING, "restarting", restarts=0)
            self._launch(inst)

    def _launch(self, inst: ModelInstance, run: BackendRun | None = None) -> BackendRun:
        run = run or BackendRun(instance_id=inst.pk)
        run.model_name, run.server_type = inst.model_name, inst.type
        self.runs[inst.pk] = run
        run.lifecycle = asyncio.create_task(self._lifecycle(run), name=f"backend-{inst.pk}")
        return run

    # ------------------------------------------------------------ lifecycle
    async def _lifecycle(self, run: BackendRun) -> None:
        try:
            outcome = CRASHED if run.adopted else None
            if run.adopted:
                outcome = await self._watch_ready(run)
            else:
                outcome = await self._run_once(run)
            while outcome == CRASHED and not run.stopping:
                inst = await db_get(run.instance_id)
                if inst is None or inst.desired_state != DesiredState.RUNNING:
                    return
                if inst.restarts >= settings.RESTART_LIMIT:
                    await db_transition(run.instance_id, InstanceState.ERROR,
                                        f"gave up after {inst.restarts} restarts; last error: {inst.last_error[:300]}")
                    return
                delay = settings.RESTART_BACKOFF_S * (2 ** inst.restarts)
                await db_transition(run.instance_id, InstanceState.ERROR,
                                    f"{inst.state_message[:300]}; restarting in {delay} s", event=False)
                await asyncio.sleep(delay)
                if run.stopping:
                    return
                await db_transition(run.instance_id, InstanceState.PENDING,
                                    f"restart {inst.restarts + 1} of {settings.RESTART_LIMIT} after a crash",
                                    restarts=inst.restarts + 1)
                run.adopted = False
                outcome = await self._run_once(run)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("backend lifecycle of instance %s failed", run.instance_id)
            with contextlib.suppress(Exception):
                await self._kill(run)
                await db_transition(run.instance_id, InstanceState.ERROR, f"supervisor error: {exc}",
                                    last_error=str(exc), pid=None, pgid=None)
        finally:
            if not run.stopping and self.runs.get(run.instance_id) is run:
                await self._stop_tailer(run)
                if run.exited():
                    self.runs.pop(run.instance_id, None)

    async def _resolve_model(self, run: BackendRun, inst: ModelInstance) -> Path:
        """The local file or directory to serve: a store prefix is synced into the node cache first."""
        if inst.model_path.startswith("/"):
            path = Path(inst.model_path)
            if path.is_dir() and not (path / "config.json").is_file():
                path = gguf_in_dir(path) or path
            if not path.exists():
                raise LoadFailed(f"no file or directory at {inst.model_path} on node {inst.node.name}")
            return path
        try:
            from hub.cache import resolve_model_path, sync_to_cache
        except ImportError:
            raise LoadFailed("this console has no node cache yet: load an absolute path") from None
        await db_transition(run.instance_id, InstanceState.CACHING, "copying from the store: 0%", progress_pct=0.0)
        loop = asyncio.get_running_loop()
        last = {"at": 0.0}

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last["at"] < 0.5 and done < total:
                return
            last["at"] = now
            pct = 100.0 * done / total if total else 100.0
            asyncio.run_coroutine_threadsafe(
                db_transition(run.instance_id, InstanceState.CACHING, f"copying from the store: {pct:.0f}%",
                              event=False, progress_pct=round(pct, 1)), loop)

        fmt = inst.model_path.split("/", 1)[0]  # a validated prefix starts with its format
        try:
            local = await asyncio.to_thread(sync_to_cache, inst.model_path, node_name=inst.node.name, progress=progress)
            return Path(resolve_model_path(local, fmt))
        except Exception as exc:
            raise LoadFailed(f"copying {inst.model_path} from the store failed: {exc}") from exc

    async def _spec_for(self, run: BackendRun, inst: ModelInstance, model_file: Path) -> LaunchSpec:
        node = inst.node
        gpu_types = await _db(lambda: list(node.gpus.values_list("type", flat=True)))()
        # Version, flavour and binary as probed on this node now (the row may predate an upgrade).
        entry = next((b for b in node.backends if b.get("name") == inst.backend and b.get("available")), None)
        version, flavour, executable = "", "cpu", ""
        if entry is not None:
            gpu_type = node_gpu_type(gpu_types)
            with contextlib.suppress(Exception):
                choice = choose_backend(fmt="gguf" if inst.backend != "vllm" else "huggingface", gpu_type=gpu_type,
                                        backends=node.backends, requested=inst.backend, node_name=node.name)
                version, flavour, executable = choice.version, choice.flavour, choice.path
        # Ports of every node on this address count: several agents may share one host.
        taken = set(await _db(lambda: list(ModelInstance.objects.filter(
            node__address=node.address, state__in=ACTIVE_STATES, port__isnull=False,
        ).exclude(pk=inst.pk).values_list("port", flat=True)))())
        taken |= {r.port for pk, r in self.runs.items() if pk != inst.pk and r.port}
        try:
            port = pick_port(taken=taken, prefer=inst.port)
        except PlacementError as exc:
            raise LoadFailed(str(exc)) from None
        host = bind_host(node.address)
        return LaunchSpec(
            model_file=model_file, model_name=inst.model_name, server_type=inst.type, host=host, port=port,
            gpus=tuple(inst.gpus or ()), gpu_type=(sorted(set(gpu_types))[0] if inst.gpus and gpu_types else ""),
            flavour=flavour, version=version, executable=executable,
            tensor_parallel_size=inst.tensor_parallel_size, extra_args=inst.extra_args or {},
        )

    async def _run_once(self, run: BackendRun) -> str:
        """Start the backend and bring it to READY, then watch it. Returns how it ended."""
        inst = await db_get(run.instance_id)
        if inst is None:
            return STOPPED
        run.adapter = get_adapter(inst.backend)
        try:
            model_file = await self._resolve_model(run, inst)
            inst = await db_get(run.instance_id)
            spec = await self._spec_for(run, inst, model_file)
            cmd = run.adapter.build_command(spec)
            env = run.adapter.build_env(spec, dict(os.environ))
        except LoadFailed as exc:
            await db_transition(run.instance_id, InstanceState.ERROR, str(exc), last_error=str(exc))
            return LOAD_FAILED
        except Exception as exc:  # a bad row (e.g. extra_args no longer allowed) is an ERROR, not a crash loop
            await db_transition(run.instance_id, InstanceState.ERROR, f"cannot start: {exc}", last_error=str(exc))
            return LOAD_FAILED
        run.spec, run.port = spec, spec.port
        log_path = current_log(run.instance_id)
        run.process = await spawn_backend(cmd, env=env, log_path=log_path,
                                          previous_log=previous_log(run.instance_id))
        run.adopted = False
        await db_transition(
            run.instance_id, InstanceState.LOADING, f"starting {inst.backend} on port {spec.port}",
            port=spec.port, pid=run.process.pid, pgid=run.process.pgid, started_at=timezone.now(), exit_code=None,
            progress_pct=None, log_tail=[], ready_at=None,
        )
        self._start_tailer(run, log_path, from_start=True)
        timeout = run.adapter.load_timeout_s()
        verdict = await self._wait_healthy(run, timeout)
        if verdict != "ok":
            return await self._failed_load(run, verdict)
        await db_transition(run.instance_id, InstanceState.WARMING, "sending one warm-up request")
        warm_error = await self._warm_up(run)
        if warm_error:
            return await self._failed_load(run, warm_error)
        await db_transition(run.instance_id, InstanceState.READY, f"ready on port {spec.port}", ready_at=timezone.now())
        return await self._watch_ready(run)

    async def _failed_load(self, run: BackendRun, verdict: str) -> str:
        if run.exited():
            await asyncio.sleep(TAIL_POLL_S * 3)  # let the tailer catch the last lines
            message = f"{run.adapter.label} {describe_exit(run.process.returncode)} while loading"
        else:
            message = verdict
            await self._kill(run)
        code = run.process.returncode
        await self._stop_tailer(run)
        last = run.last_lines()
        await db_transition(run.instance_id, InstanceState.ERROR, message,
                            last_error=f"{message}\n{last}".strip(), exit_code=code, pid=None, pgid=None,
                            log_tail=list(run.tail), stopped_at=timezone.now())
        return LOAD_FAILED

    async def _watch_ready(self, run: BackendRun) -> str:
        code = await run.process.wait()
        if run.stopping:
            return STOPPED
        await asyncio.sleep(TAIL_POLL_S * 3)
        await self._stop_tailer(run)
        run.process.kill_rest()  # nothing of the dead backend's group may linger
        message = f"{run.adapter.label if run.adapter else 'backend'} {describe_exit(code)} while READY"
        await db_transition(run.instance_id, InstanceState.ERROR, message,
                            last_error=f"{message}\n{run.last_lines()}".strip(), exit_code=code, pid=None, pgid=None,
                            log_tail=list(run.tail))
        return CRASHED

    async def _wait_healthy(self, run: BackendRun, timeout: float) -> str:
        """'ok' once the backend's own health answers; else why not (exited / timed out)."""
        url = f"http://{url_host(run.spec.host)}:{run.port}{run.adapter.health_path}"
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            if run.exited():
                return "exited"
            try:
                r = await self.http.get(url, timeout=2.0)
                if r.status_code == 200 and await asyncio.to_thread(listener_is_ours, run.process.pgid, run.port):
                    return "ok"
            except httpx.HTTPError:
                pass
            # A ready line in the log only makes the next poll come sooner.
            hint = run.tailer.ready_hint
            with contextlib.suppress(TimeoutError):
                fast = time.monotonic() - started < FAST_POLL_FOR_S
                await asyncio.wait_for(hint.wait(), HEALTH_POLL_FAST_S if fast else HEALTH_POLL_S)
            hint.clear()
        return f"{run.adapter.label} did not answer {run.adapter.health_path} within {timeout:g} s"

    async def _warm_up(self, run: BackendRun) -> str | None:
        path, body = run.adapter.warmup_request(run.spec)
        try:
            r = await self.http.post(f"http://{url_host(run.spec.host)}:{run.port}{path}", json=body,
                                     timeout=WARMUP_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return f"the warm-up request to {path} failed: {exc.__class__.__name__}"
        if r.status_code != 200:
            return f"the warm-up request to {path} answered {r.status_code}: {r.text[:200]}"
        return None

    # ------------------------------------------------------------ log tailing
    def _start_tailer(self, run: BackendRun, path: Path, *, from_start: bool) -> None:
        instance_id = run.instance_id

        async def on_lines(lines: list[str], offset: int) -> None:
            await events.log_lines(instance_id, lines, offset)

        async def on_flush(lines: list[str]) -> None:
            await db_save_tail(instance_id, lines)

        run.tailer = LogTailer(path, hints=run.adapter.ready_hints if run.adapter else (),
                               on_lines=on_lines, on_flush=on_flush)
        run.tailer.start(from_start=from_start)

    async def _stop_tailer(self, run: BackendRun) -> None:
        if run.tailer is not None:
            await run.tailer.stop()

    # ------------------------------------------------------------ stopping
    async def _kill(self, run: BackendRun) -> None:
        """SIGTERM the process group, wait STOP_GRACE_S, SIGKILL the group, reap."""
        if run.process is not None:
            await run.process.stop(settings.STOP_GRACE_S)

    async def stop_instance(self, instance_id: int, reason: str, *, keep_desired: bool = False) -> None:
        """Stop the backend of an instance: UNLOADING, kill the group, reap, STOPPED with port and GPUs freed."""
        run = self.runs.get(instance_id)
        if run is None:
            return
        run.stopping = True
        inst = await db_get(instance_id)
        if inst is not None and inst.state != InstanceState.STOPPED:
            await db_transition(instance_id, InstanceState.UNLOADING, reason)
        if run.lifecycle is not None and not run.lifecycle.done():
            run.lifecycle.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await run.lifecycle
        await self._kill(run)
        await self._stop_tailer(run)
        self.runs.pop(instance_id, None)
        if inst is not None:
            fields = {"pid": None, "pgid": None, "port": None, "stopped_at": timezone.now(), "progress_pct": None,
                      "exit_code": run.process.returncode if run.process else None}
            if not keep_desired:
                fields["gpus"] = []
            await db_transition(instance_id, InstanceState.STOPPED, reason, **fields)

    # ------------------------------------------------------------ agent restart
    def _recorded(self) -> list[ModelInstance]:
        return list(ModelInstance.objects.select_related("node").filter(node__name=self.agent.name, pid__isnull=False))

    def _interrupted(self) -> list[ModelInstance]:
        return list(ModelInstance.objects.filter(
            node__name=self.agent.name, pid__isnull=True, desired_state=DesiredState.RUNNING,
            state__in=(InstanceState.CACHING, InstanceState.LOADING, InstanceState.WARMING)))

    async def adopt_or_stop_orphans(self) -> None:
        """Backends a previous agent started: adopt the healthy ones, stop the rest. Loads it left
        half done with no process (a copy into the cache) go back to PENDING, saying why."""
        for inst in await _db(self._interrupted)():
            await db_transition(inst.pk, InstanceState.PENDING,
                                f"the node agent restarted while {inst.state}; starting the load again",
                                progress_pct=None)
        for inst in await _db(self._recorded)():
            pid, pgid = inst.pid, inst.pgid or inst.pid
            cmd = proc_cmdline(pid) if pid_alive(pid) else []
            ours = bool(cmd) and inst.model_name in cmd and str(inst.port) in cmd
            if not ours:
                await db_transition(inst.pk, InstanceState.STOPPED if inst.state in ACTIVE_STATES else inst.state,
                                    "backend gone after an agent restart", pid=None, pgid=None)
                continue
            adapter = get_adapter(inst.backend)
            run = BackendRun(instance_id=inst.pk, adapter=adapter, model_name=inst.model_name, server_type=inst.type,
                             port=inst.port, process=BackendProcess(pid=pid, pgid=pgid), adopted=True)
            healthy = False
            if inst.state == InstanceState.READY:
                try:
                    host = url_host(bind_host(inst.node.address))
                    r = await self.http.get(f"http://{host}:{inst.port}{adapter.health_path}", timeout=3.0)
                    healthy = r.status_code == 200 and await asyncio.to_thread(listener_is_ours, pgid, inst.port)
                except httpx.HTTPError:
                    healthy = False
            if healthy:
                self.runs[inst.pk] = run
                self._start_tailer(run, current_log(inst.pk), from_start=False)
                await db_transition(inst.pk, InstanceState.READY, f"adopted after an agent restart (pid {pid})")
                self._launch(inst, run)
                log.info("adopted backend pid %s of %s", pid, inst)
            else:
                await self._kill(run)
                await db_transition(inst.pk, InstanceState.STOPPED,
                                    f"stopped a backend the previous agent left {inst.state} (pid {pid})",
                                    pid=None, pgid=None, port=None)
