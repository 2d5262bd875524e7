"""The fleet's history: samples per node and GPU (written by each node agent) and per model
(written by each web process from the proxy's counters), kept in three resolutions.

`step` is the resolution in seconds (10, 300 or 3600) and `at` the slot's start (epoch seconds):
integers keep the rows small, and one index (step, at, ...) serves the reads, the roll-ups and
the pruning alike.
"""
from __future__ import annotations

from django.db import models

HOST_GPU = -1  # the `gpu` of a node's own row: RAM and CPU
ALL_GPUS = -2  # the `gpu` of a node's GPUs summed (memory) and averaged (utilization): the dashboard reads these


class ResourceSample(models.Model):
    """One node's RAM/CPU (gpu = -1), all its GPUs together (gpu = -2) or one GPU's memory and
    utilization, averaged over a slot."""

    step = models.SmallIntegerField()
    at = models.BigIntegerField()
    node = models.CharField(max_length=100)
    gpu = models.SmallIntegerField(default=HOST_GPU)
    mem_used_mib = models.IntegerField(default=0)
    mem_total_mib = models.IntegerField(default=0)
    mem_alloc_mib = models.IntegerField(default=0, help_text="booked by instances (GPUs only)")
    util_pct = models.FloatField(null=True, help_text="GPU utilization, or CPU % on the host row")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["step", "at", "node", "gpu"], name="uniq_resource_sample")]


class ModelSample(models.Model):
    """One model's traffic in a slot, summed over every web process; latencies as histograms
    (counts per bucket of history.samples.LATENCY_BOUNDS_MS), so slots and processes add up."""

    step = models.SmallIntegerField()
    at = models.BigIntegerField()
    model = models.CharField(max_length=255)
    requests = models.IntegerField(default=0)
    errors = models.IntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    latency_hist = models.JSONField(default=list)
    ttft_hist = models.JSONField(default=list)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["step", "at", "model"], name="uniq_model_sample")]
