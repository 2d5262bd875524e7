"""The node agent's hardware worker: detect GPUs and backends at start, refresh metrics after.

It speaks the agent's worker protocol (name, start, run, stop) without importing serving:
hardware sits below serving and never imports it at module level.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections

from hardware.backends import probe_backends
from hardware.detectors import DETECTORS, DetectionReport, Detector, detect
from hardware.detectors.base import DetectorAttempt, DetectorUnavailable
from hardware.detectors.cpu import cpu_percent, read_cpu_info, read_cpu_times

log = logging.getLogger("xgen.hardware")


@dataclass
class InventoryResult:
    report: DetectionReport
    backends: list[dict] | None  # None: keep what is stored (refreshes do not re-probe)


def collect_inventory(chain: list[Detector] | None = None) -> InventoryResult:
    """Full inventory: the detector chain and the backend probe (blocking; run in a thread)."""
    return InventoryResult(report=detect(chain), backends=probe_backends())


def refresh_inventory(previous: DetectionReport, detector: Detector | None) -> InventoryResult:
    """Fresh metrics from the detector that won at start; the earlier attempts are kept."""
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
    return InventoryResult(report=report, backends=None)


class InventoryWorker:
    """Agent worker `hardware`: inventory at start, then a refresh every HARDWARE_REFRESH_S."""

    name = "hardware"

    def __init__(self, chain: list[Detector] | None = None) -> None:
        self.chain = chain
        self.report: DetectionReport | None = None
        self._detector: Detector | None = None
        self._cpu_times = read_cpu_times()

    async def start(self, agent: Any) -> None:
        result = await asyncio.to_thread(collect_inventory, self.chain)
        self.report = result.report
        chain = self.chain if self.chain is not None else [cls() for cls in DETECTORS.values()]
        self._detector = next((d for d in chain if d.name == result.report.detector), None)
        await sync_to_async(self._save)(agent.name, result)
        log.info("hardware on %s: detector %s, %d GPU(s), backends %s", agent.name, result.report.detector,
                 len(result.report.gpus), [b["name"] for b in result.backends or [] if b["available"]])
        await self._publish()

    async def run(self, agent: Any) -> None:
        while True:
            await asyncio.sleep(settings.HARDWARE_REFRESH_S)
            await self.refresh(agent)

    async def refresh(self, agent: Any) -> None:
        """One refresh: re-read metrics, save, publish the GPUs page fragment."""
        if self.report is None:
            return await self.start(agent)
        result = await asyncio.to_thread(refresh_inventory, self.report, self._detector)
        times = read_cpu_times()
        result.report.cpu.percent = cpu_percent(self._cpu_times, times)
        self._cpu_times = times
        self.report = result.report
        await sync_to_async(self._save)(agent.name, result)
        await self._publish()

    async def stop(self, agent: Any) -> None:
        return None

    @staticmethod
    def _save(node_name: str, result: InventoryResult) -> None:
        from hardware.services import save_inventory

        close_old_connections()
        save_inventory(node_name=node_name, result=result)

    @staticmethod
    async def _publish() -> None:
        from hardware.events import publish_gpus

        await publish_gpus()
