"""Writes for nodes: registration and heartbeats (called by the node agent)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from hardware.detectors.base import DetectionReport
from hardware.models import GpuDevice, Heartbeat, Node

HEARTBEAT_HISTORY = timedelta(hours=1)



@dataclass
class InventoryResult:
    report: DetectionReport
    backends: list[dict] | None  # None: keep what is stored (refreshes do not re-probe)


def register_node(*, name: str, address: str) -> Node:
    """Create or update this agent's node row and mark it alive now."""
    now = timezone.now()
    node, _ = Node.objects.update_or_create(
        name=name,
        defaults={"address": address, "started_at": now, "last_heartbeat": now, "agent_pid": os.getpid(),
                  "model_memory_mib": settings.NODE_MEMORY_MIB},
    )
    return node


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


def save_inventory(*, node_name: str, result: InventoryResult) -> Node:
    """Store what the node's inventory found: detector, report, CPU/RAM, backends, GPUs.

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
        node.save(update_fields=["detector", "detection_report", "cpu_count", "memory_total_mib",
                                 "memory_used_mib", "cpu_percent", "backends"])
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
