"""Writes for nodes: registration and heartbeats (called by the node agent)."""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
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
    backends: list[dict[str, Any]] | None  # None: keep what is stored (refreshes do not re-probe)


class NodeHeld(RuntimeError):
    """Another agent process holds the node and beats fresh heartbeats for it: this one may not
    take it (two hosts of one hostname, two pods of a rolling update)."""


class NodeTaken(RuntimeError):
    """The node this agent held was taken by another agent (this one had not beaten for longer
    than XGEN_NODE_STALE_AFTER): the agent stops, leaving the node's rows to the new holder."""

    def __init__(self, message: str, *, holder_host: str) -> None:
        super().__init__(message)
        self.holder_host = holder_host


def host_identity() -> str:
    """This host as agents tell one another apart: hostname#boot id (two hosts of one hostname
    differ in the second, so a pid is only ever checked on the host that has it)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = ""
    return f"{socket.gethostname()}#{boot}"


def _pid_gone(pid: int) -> bool:
    """Whether no live process of this host has `pid` (a zombie counts as gone)."""
    if pid == os.getpid():  # the holder was this process (an earlier agent of it) or a dead one with our pid
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _holder(node: Node) -> str:
    host = node.agent_host.split("#", 1)[0] or "an unknown host"
    return f"pid {node.agent_pid} on {host}"


def _held_by_another(node: Node, *, agent_id: str, host: str) -> str | None:
    """Why the agent `agent_id` on `host` may not take `node` now, or None when it may: the node
    is free, or its holder is this agent, stopped cleanly, has not beaten for
    XGEN_NODE_STALE_AFTER, or is a dead process of this host (an agent killed and restarted)."""
    if not node.agent_id or node.agent_id == agent_id:
        return None
    age = node.heartbeat_age_s
    stale_after = settings.NODE_STALE_AFTER_S
    if age is None or age > stale_after:
        return None
    if node.agent_host == host and node.agent_pid and _pid_gone(node.agent_pid):
        return None
    return (f"node {node.name!r} is held by another node agent ({_holder(node)}, last heartbeat "
            f"{max(age, 0):.1f} s ago); each node name must have one agent. This agent may take the node "
            f"once that one stops (a clean stop frees it at once) or has not beaten for {stale_after} s "
            f"(XGEN_NODE_STALE_AFTER): in {max(stale_after - age, 0):.1f} s at the earliest")


def register_node(*, name: str, address: str, run: str = "", agent_id: str = "", host: str = "") -> Node:
    """Create or update this agent's node row and mark it alive now. `run`: the agent run's id;
    the stored inventory counts as stale until that run saves one ('': nothing to wait for).
    `agent_id`/`host`: the agent process taking the node; raises NodeHeld while another agent
    process holds it ('': take it regardless, as a test's or a script's registration does)."""
    now = timezone.now()
    fields = {"address": address, "started_at": now, "last_heartbeat": now, "agent_pid": os.getpid(),
              "model_memory_mib": settings.NODE_MEMORY_MIB, "agent_run": run,
              "agent_id": agent_id, "agent_host": host if agent_id else "", "draining_since": None}
    with transaction.atomic():
        # Locked: two agents registering at once see each other (the second waits, then is refused).
        node = Node.objects.select_for_update().filter(name=name).first()
        if node is None:
            try:
                with transaction.atomic():
                    return Node.objects.create(name=name, **fields)
            except IntegrityError:  # another agent created the row just now
                node = Node.objects.select_for_update().get(name=name)
        if agent_id:
            held = _held_by_another(node, agent_id=agent_id, host=host)
            if held:
                raise NodeHeld(held)
        for key, value in fields.items():
            setattr(node, key, value)
        node.save(update_fields=list(fields))
    return node


def release_node(*, name: str, agent_id: str) -> bool:
    """A clean stop: the node is free for the next agent at once (if `agent_id` still holds it)."""
    return bool(Node.objects.filter(name=name, agent_id=agent_id).update(agent_id=""))


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


def record_heartbeat(*, name: str, instances_running: int = 0, agent_id: str = "", host: str = "") -> Node:
    """Refresh the heartbeat; keep a short history for the node page. With `agent_id`, only while
    that agent holds the node (a node freed by a registration without one is taken back); raises
    NodeTaken when another agent holds it now."""
    now = timezone.now()
    with transaction.atomic():
        if agent_id:
            if not Node.objects.filter(name=name, agent_id__in=(agent_id, "")).update(
                    last_heartbeat=now, agent_id=agent_id, agent_host=host):
                other = Node.objects.filter(name=name).first()
                if other is not None:
                    raise NodeTaken(f"node {name!r} was taken by another node agent ({_holder(other)}; this one's "
                                    f"heartbeat was older than XGEN_NODE_STALE_AFTER, {settings.NODE_STALE_AFTER_S} s, "
                                    "or the row was changed): this agent stops and leaves the node to it",
                                    holder_host=other.agent_host)
        else:
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
