"""Writes for nodes: registration and heartbeats (called by the node agent)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from hardware.detectors.base import DetectionReport
from hardware.models import GpuDevice, Heartbeat, Node

HEARTBEAT_HISTORY = timedelta(hours=1)
# Node name -> the run id of the node agent this process hosts (set before it registers): its
# node's inventory is stale, here, until that run has saved one (planning, /readyz).
LOCAL_AGENT_RUNS: dict[str, str] = {}



@dataclass
class InventoryResult:
    report: DetectionReport
    backends: list[dict] | None  # None: keep what is stored (refreshes do not re-probe)


def register_node(*, name: str, address: str, run: str = "") -> Node:
    """Create or update this agent's node row and mark it alive now. `run`: the agent run's id;
    the stored inventory counts as stale until that run saves one ('': nothing to wait for)."""
    now = timezone.now()
    node, _ = Node.objects.update_or_create(
        name=name,
        defaults={"address": address, "started_at": now, "last_heartbeat": now, "agent_pid": os.getpid(),
                  "model_memory_mib": settings.NODE_MEMORY_MIB, "agent_run": run},
    )
    return node


def wait_for_inventory(node: Node, *, timeout_s: float) -> Node | None:
    """The node's row (read again) once its inventory comes from its agent's current run, waiting
    up to `timeout_s` for the fresh probe; None if it has not come by then."""
    deadline = time.monotonic() + timeout_s
    while not node.inventory_current(LOCAL_AGENT_RUNS.get(node.name, "")):
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)
        node = Node.objects.get(pk=node.pk)
    return node


def local_inventory_pending() -> list[str]:
    """The nodes whose agent runs in this process and has not saved its first inventory yet."""
    return sorted(name for name, run in list(LOCAL_AGENT_RUNS.items())
                  if not Node.objects.filter(name=name, inventory_run=run).exists())


def record_heartbeat(*, name: str, instances_running: int = 0) -> Node:
    """Refresh the heartbeat; keep a short history for the node page."""
    now = timezone.now()
    with transaction.atomic():
        Node.objects.filter(name=name).update(last_heartbeat=now)
        node = Node.objects.get(name=name)
        Heartbeat.objects.create(
            node=node,
            at=now,
            gpu_count=node.gpus.count(),
            memory_used_mib=node.memory_used_mib,
            instances_running=instances_running,
        )
        Heartbeat.objects.filter(node=node, at__lt=now - HEARTBEAT_HISTORY).delete()
    return node


def save_inventory(*, node_name: str, result: InventoryResult, run: str = "") -> Node:
    """Store what the node's inventory found: detector, report, CPU/RAM, backends, GPUs, and the
    agent run (`run`) and time it came from.

    GPUs are upserted by index and the ones that vanished are deleted, in one transaction,
    so a page never sees half an inventory.
    """
    report = result.report
    now = timezone.now()
    with transaction.atomic():
        node = Node.objects.select_for_update().get(name=node_name)
        node.detector = report.detector
        node.detection_report = report.attempts_as_dicts()
        node.cpu_count = report.cpu.cores
        node.memory_total_mib = report.cpu.memory_total_mib
        node.memory_used_mib = report.cpu.memory_used_mib
        node.cpu_percent = report.cpu.percent
        if result.backends is not None:
            node.backends = result.backends
        node.inventory_run, node.inventory_at = run, now
        node.save(update_fields=["detector", "detection_report", "cpu_count", "memory_total_mib",
                                 "memory_used_mib", "cpu_percent", "backends", "inventory_run", "inventory_at"])
        seen = []
        for gpu in report.gpus:
            GpuDevice.objects.update_or_create(
                node=node,
                index=gpu.index,
                defaults={
                    "uuid": gpu.uuid, "vendor": gpu.vendor, "type": gpu.type, "name": gpu.name, "arch": gpu.arch,
                    "driver_version": gpu.driver_version, "memory_total_mib": gpu.memory_total_mib,
                    "memory_used_mib": gpu.memory_used_mib, "utilization_pct": gpu.utilization_pct,
                    "temperature_c": gpu.temperature_c, "updated_at": now,
                },
            )
            seen.append(gpu.index)
        GpuDevice.objects.filter(node=node).exclude(index__in=seen).delete()
    return node
