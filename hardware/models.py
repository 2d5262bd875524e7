"""Nodes (one per node agent) and the GPUs they report."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone

from hardware.llama_build import build_in_rows


class GpuType(models.TextChoices):
    NVIDIA = "NVIDIA"
    AMD_CDNA = "AMD_CDNA"
    AMD_RDNA = "AMD_RDNA"
    CPU = "CPU"


class NodeStatus(models.TextChoices):
    ONLINE = "online"
    STALE = "stale"
    OFFLINE = "offline"


class Node(models.Model):
    name = models.CharField(max_length=100, unique=True)
    address = models.CharField(max_length=255, help_text="host the web processes reach backends on")
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    agent_pid = models.IntegerField(null=True, blank=True)
    # [{"name": "llama-cpp-python", "version": "0.3.16", "flavour": "cpu", ...}]
    backends = models.JSONField(default=list, blank=True)
    # [{"detector": "amdsmi", "ok": false, "reason": "libamd_smi.so not found"}, ...]
    detection_report = models.JSONField(default=list, blank=True)
    detector = models.CharField(max_length=32, blank=True, help_text="the detector that succeeded")
    cpu_count = models.IntegerField(default=0)
    memory_total_mib = models.BigIntegerField(default=0)
    memory_used_mib = models.BigIntegerField(default=0)
    cpu_percent = models.FloatField(null=True, blank=True)
    model_memory_mib = models.BigIntegerField(
        default=0, db_default=0, help_text="XGEN_NODE_MEMORY_MIB of its agent: the most it offers to models (0: no cap)")
    # Which agent run the row's inventory (GPUs, CPU/RAM, backends) came from: a load planned just
    # after an agent restart must not read the previous run's (issue 32 #5).
    agent_run = models.CharField(max_length=32, blank=True, default="", db_default="",
                                 help_text="the run id of the agent that registered last ('': none given)")
    inventory_run = models.CharField(max_length=32, blank=True, default="", db_default="",
                                     help_text="the agent run the stored inventory came from")
    inventory_at = models.DateTimeField(null=True, blank=True, help_text="when the inventory was saved")
    # Which agent process holds the node: a second agent of the same name is refused while this
    # one beats (issue 35 #2); '' once it stopped cleanly (the next one takes the node at once).
    agent_id = models.CharField(max_length=32, blank=True, default="", db_default="",
                                help_text="the id of the agent process holding the node ('': none)")
    agent_host = models.CharField(max_length=300, blank=True, default="", db_default="",
                                  help_text="the holding agent's host: hostname#boot id")
    # Its agent got SIGTERM and is draining (issue 31 #4): it finishes what it serves, but no load,
    # replica or relocation is placed on it; cleared when an agent registers the node again.
    draining_since = models.DateTimeField(null=True, blank=True,
                                          help_text="when its agent began draining (null: not draining)")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def heartbeat_age_s(self) -> float | None:
        if self.last_heartbeat is None:
            return None
        return (timezone.now() - self.last_heartbeat).total_seconds()

    @property
    def status(self) -> str:
        age = self.heartbeat_age_s
        if age is None or age > settings.NODE_OFFLINE_AFTER_S:
            return NodeStatus.OFFLINE
        if age > settings.NODE_STALE_AFTER_S:
            return NodeStatus.STALE
        return NodeStatus.ONLINE

    @property
    def is_online(self) -> bool:
        return self.status == NodeStatus.ONLINE

    @property
    def llama_build(self) -> dict[str, Any] | None:
        """The llama.cpp build running (or failed) on this node, as its probe recorded it
        (hardware.llama_build.BuildState.to_json), else None."""
        return build_in_rows(self.backends)

    @property
    def backend_names(self) -> list[str]:
        return [b["name"] for b in self.backends if b.get("available", True)]

    def inventory_current(self, expected_run: str = "") -> bool:
        """Whether the stored inventory comes from the agent's current run (`expected_run`, when
        this process hosts that agent, else the run it registered); a row registered without a
        run (an agent without the hardware worker) has nothing to wait for."""
        run = expected_run or self.agent_run
        return not run or self.inventory_run == run

    @classmethod
    def fresh(cls) -> models.QuerySet:
        """Nodes whose agent heartbeated recently enough to serve (routing reads these)."""
        cutoff = timezone.now() - timedelta(seconds=settings.NODE_STALE_AFTER_S)
        return cls.objects.filter(last_heartbeat__gte=cutoff)

    @classmethod
    def placeable(cls) -> models.QuerySet:
        """Fresh nodes that may take new work: not draining (loads, replicas and relocations)."""
        return cls.fresh().filter(draining_since__isnull=True)


class GpuDevice(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.IntegerField()
    uuid = models.CharField(max_length=128, blank=True)
    vendor = models.CharField(max_length=32)
    type = models.CharField(max_length=16, choices=GpuType.choices)
    name = models.CharField(max_length=128)
    arch = models.CharField(max_length=32, blank=True, help_text="gfx version or compute capability")
    driver_version = models.CharField(max_length=64, blank=True)
    memory_total_mib = models.BigIntegerField(default=0)
    memory_used_mib = models.BigIntegerField(default=0)
    utilization_pct = models.FloatField(null=True, blank=True)
    temperature_c = models.FloatField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["node__name", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="uniq_gpu_per_node_index")]

    def __str__(self) -> str:
        return f"{self.node.name}:{self.index} {self.name}"

    @property
    def memory_free_mib(self) -> int:
        return max(0, self.memory_total_mib - self.memory_used_mib)

    @property
    def memory_used_pct(self) -> float:
        return 100.0 * self.memory_used_mib / self.memory_total_mib if self.memory_total_mib else 0.0


class Heartbeat(models.Model):
    """A sample of each heartbeat, kept briefly for the node page's history."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="heartbeats")
    at = models.DateTimeField(default=timezone.now, db_index=True)
    gpu_count = models.IntegerField(default=0)
    memory_used_mib = models.BigIntegerField(default=0)
    instances_running = models.IntegerField(default=0)

    class Meta:
        ordering = ["-at"]
