"""The node agent's hardware worker: detect GPUs and backends at start, refresh metrics after.

It speaks the agent's worker protocol (name, start, run, stop) without importing serving:
hardware sits below serving and never imports it at module level.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from django.conf import settings

from hardware.backends import probe_backends
from hardware.dashboard import record_node_sample
from hardware.detectors import DETECTORS, DetectionReport, Detector, detect
from hardware.detectors.base import DetectorAttempt, DetectorUnavailable
from hardware.detectors.cpu import cpu_percent, read_cpu_info, read_cpu_times
from hardware.events import publish_dashboard_node, publish_gpus, publish_node
from hardware.llama_build import build_in_rows
from hardware.services import InventoryResult, save_inventory
from live.db import run_db

log = logging.getLogger("xgen.hardware")

# Backends change only when someone installs one; re-probe every this many refreshes (~5 min).
BACKEND_REPROBE_EVERY = 30


def _say_build(node: str, before: dict[str, Any] | None, now: dict[str, Any] | None,
               backends: list[dict[str, Any]]) -> None:
    """Say in the console's own log (the terminal of `bootstrap.sh run`) when the build starts to be
    seen, fails, or ends: the pages show it, but whoever watches the terminal learns it there."""
    state_before, state_now = (before or {}).get("state"), (now or {}).get("state")
    label = (now or {}).get("label")
    if state_now == state_before == "building" and not (before or {}).get("libraries_ready") \
            and (now or {}).get("libraries_ready"):
        log.info("%s on %s; llama-cpp-python can serve now", label, node)
        return
    if state_now == state_before:
        return
    if state_now == "building":
        log.info("%s on %s; loads of llama-cpp-python wait for its libraries, llama-server for the whole build",
                 label, node)
    elif state_now == "failed":
        log.warning("%s on %s; loads of llama-server and llama-cpp-python fail until it is built "
                    "(run deploy/bootstrap.sh again)", label, node)
    elif state_before == "building":
        log.info("llama.cpp on %s: the build ended; backends %s", node, [b["name"] for b in backends if b["available"]])


def collect_inventory(chain: list[Detector] | None = None) -> InventoryResult:
    """Full inventory: the detector chain and the backend probe (blocking; run in a thread)."""
    return InventoryResult(report=detect(chain), backends=probe_backends())


def refresh_inventory(previous: DetectionReport, detector: Detector | None, *, reprobe: bool = False) -> InventoryResult:
    """Fresh metrics from the detector that won at start (earlier attempts kept); backends if `reprobe`."""
    gpus = previous.gpus
    attempts = previous.attempts
    if detector is not None:
        try:
            gpus = detector.detect()
        except DetectorUnavailable as exc:
            # A GPU that stops answering (driver reset) shows on the node's report, not as stale numbers.
            gpus = []
            attempts = [a for a in attempts if a.detector != detector.name]
            attempts.append(DetectorAttempt(detector=detector.name, ok=False, reason=f"refresh failed: {exc}"))
    report = DetectionReport(detector=previous.detector, gpus=gpus, cpu=read_cpu_info(), attempts=attempts)
    return InventoryResult(report=report, backends=probe_backends() if reprobe else None)


class InventoryWorker:
    """Agent worker `hardware`: inventory at start, then a refresh every HARDWARE_REFRESH_S."""

    name = "hardware"

    def __init__(self, chain: list[Detector] | None = None) -> None:
        self.chain = chain
        self.report: DetectionReport | None = None
        self._detector: Detector | None = None
        self._cpu_times = read_cpu_times()
        self._refreshes = 0
        self._build: dict[str, Any] | None = None  # a llama.cpp build runs (or failed): re-probe at every refresh

    async def start(self, agent: Any) -> None:
        """Run the detector chain and the backend probe; save and publish before the agent counts as started."""
        result = await asyncio.to_thread(collect_inventory, self.chain)
        self.report = result.report
        self._build = build_in_rows(result.backends)
        _say_build(agent.name, None, self._build, result.backends or [])
        chain = self.chain if self.chain is not None else [cls() for cls in DETECTORS.values()]
        self._detector = next((d for d in chain if d.name == result.report.detector), None)
        await run_db(save_inventory, node_name=agent.name, result=result, run=getattr(agent, "run_id", ""))
        log.info("hardware on %s: detector %s, %d GPU(s), backends %s", agent.name, result.report.detector,
                 len(result.report.gpus), [b["name"] for b in result.backends or [] if b["available"]])
        await publish_gpus()
        await self.sample(agent)

    async def run(self, agent: Any) -> None:
        """Refresh every HARDWARE_REFRESH_S until cancelled."""
        while True:
            await asyncio.sleep(settings.HARDWARE_REFRESH_S)
            await self.refresh(agent)

    async def refresh(self, agent: Any) -> None:
        """One refresh: re-read metrics, save, publish the GPUs page fragment."""
        if self.report is None:
            return await self.start(agent)
        self._refreshes += 1
        reprobe = self._build is not None or self._refreshes % BACKEND_REPROBE_EVERY == 0
        result = await asyncio.to_thread(refresh_inventory, self.report, self._detector, reprobe=reprobe)
        if result.backends is not None:
            build = build_in_rows(result.backends)
            _say_build(agent.name, self._build, build, result.backends)
            self._build = build
        times = read_cpu_times()
        result.report.cpu.percent = cpu_percent(self._cpu_times, times)
        self._cpu_times = times
        self.report = result.report
        await run_db(save_inventory, node_name=agent.name, result=result, run=getattr(agent, "run_id", ""))
        await publish_node(agent.name)
        await self.sample(agent)

    async def sample(self, agent: Any) -> None:
        """Keep the refresh as the dashboard's 10 s sample and push it to open dashboards."""
        try:
            await run_db(record_node_sample, agent.name)
        except Exception as exc:  # a lost sample is a gap in a chart, never a failed refresh
            log.warning("sampling %s for the dashboard failed: %s", agent.name, exc)
            return
        await publish_dashboard_node(agent.name)

    async def stop(self, agent: Any) -> None:
        """Nothing to stop: the worker owns no process."""
        return None
