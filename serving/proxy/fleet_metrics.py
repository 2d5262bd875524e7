"""The dashboard's figures for Prometheus, read from the database at scrape time.

Per node and GPU: memory used/total, utilization, temperature and the holding instance;
instances by state; node cache bytes used/free; download and upload bytes. These live in their
own registry, rendered by `render_fleet()` in a worker thread (the proxy awaits it through
live.db.run_db), so a scrape never blocks the event loop on the database; the proxy's own
in-process counters stay in the default registry.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from django.db.models import Count, Sum
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from hardware.models import GpuDevice, Node
from hub.models import CacheDisk, DownloadJob, DownloadStatus, UploadJob, UploadStatus
from serving.control.allocation import active_holders
from serving.models import InstanceEvent, InstanceState, ModelInstance

MIB = 2**20

# Every family this module exports (the Grafana dashboard's test checks its queries against them).
FAMILIES = (
    "xgen_node_up", "xgen_gpu_memory_used_bytes", "xgen_gpu_memory_total_bytes", "xgen_gpu_utilization_percent",
    "xgen_gpu_temperature_celsius", "xgen_gpu_holder_info", "xgen_instances", "xgen_node_cache_used_bytes",
    "xgen_node_cache_free_bytes", "xgen_node_cache_max_bytes", "xgen_download_bytes", "xgen_download_jobs",
    "xgen_upload_bytes", "xgen_upload_jobs", "xgen_idle_unloads", "xgen_evictions",
)


class FleetCollector:
    """One pass over the database per scrape: a handful of queries whatever the cluster size."""

    def describe(self) -> list:
        return []  # no DB work when the registry is built

    def collect(self) -> Iterator[Metric]:
        yield from self._nodes_and_gpus()
        yield from self._instances()
        yield from self._caches()
        yield from self._jobs()

    def _nodes_and_gpus(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("xgen_node_up", "1 while the node's agent heartbeats (status online)", labels=["node"])
        nodes = {n.pk: n for n in Node.objects.all()}
        for node in nodes.values():
            up.add_metric([node.name], 1.0 if node.status == "online" else 0.0)
        yield up
        holders: dict[tuple[int, int], tuple[int, str]] = {}
        for node_id, gpus, holder in active_holders():
            for index in gpus:
                holders[(node_id, int(index))] = (holder.id, holder.model_name)
        labels = ["node", "gpu", "name"]
        used = GaugeMetricFamily("xgen_gpu_memory_used_bytes", "GPU memory in use", labels=labels)
        total = GaugeMetricFamily("xgen_gpu_memory_total_bytes", "GPU memory in all", labels=labels)
        util = GaugeMetricFamily("xgen_gpu_utilization_percent", "GPU utilization (0-100)", labels=labels)
        temp = GaugeMetricFamily("xgen_gpu_temperature_celsius", "GPU temperature", labels=labels)
        held = GaugeMetricFamily("xgen_gpu_holder_info",
                                 "1 for the instance holding a GPU (no series while it is free)",
                                 labels=["node", "gpu", "instance", "model"])
        for gpu in GpuDevice.objects.all().order_by("node_id", "index"):
            node = nodes.get(gpu.node_id)
            if node is None:
                continue
            key = [node.name, str(gpu.index), gpu.name]
            used.add_metric(key, gpu.memory_used_mib * MIB)
            total.add_metric(key, gpu.memory_total_mib * MIB)
            if gpu.utilization_pct is not None:
                util.add_metric(key, gpu.utilization_pct)
            if gpu.temperature_c is not None:
                temp.add_metric(key, gpu.temperature_c)
            held_by = holders.get((gpu.node_id, gpu.index))
            if held_by is not None:
                held.add_metric([node.name, str(gpu.index), str(held_by[0]), held_by[1]], 1.0)
        yield from (used, total, util, temp, held)

    def _instances(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("xgen_instances", "Model instances by state (every state, zeros included)",
                                   labels=["state"])
        counts = Counter(dict(ModelInstance.objects.values_list("state").annotate(n=Count("id"))))
        for state in InstanceState.values:
            family.add_metric([state], counts.get(state, 0))
        yield family
        # From the timelines, so every node's idle unloads and every process's evictions count (totals
        # so far, as gauges like the rest of these families: every web process exports the same figure).
        for name, help_text, prefix in (
                ("xgen_idle_unloads", "on_demand instances unloaded for idleness (back to IDLE)", "idle unload"),
                ("xgen_evictions", "on_demand instances evicted to make room for another model", "evicted")):
            counter = GaugeMetricFamily(name, help_text, labels=["model"])
            rows = (InstanceEvent.objects.filter(to_state=InstanceState.IDLE, message__startswith=prefix)
                    .values_list("instance__model_name").annotate(n=Count("id")))
            for model, n in rows:
                counter.add_metric([model], n)
            yield counter

    def _caches(self) -> Iterator[Metric]:
        used = GaugeMetricFamily("xgen_node_cache_used_bytes", "Bytes of cached models on the node", labels=["node"])
        free = GaugeMetricFamily("xgen_node_cache_free_bytes", "Free bytes on the node's cache disk", labels=["node"])
        limit = GaugeMetricFamily("xgen_node_cache_max_bytes", "XGEN_CACHE_MAX_GB of the node (0 = no limit)",
                                  labels=["node"])
        for disk in CacheDisk.objects.select_related("node"):
            used.add_metric([disk.node.name], disk.used_bytes)
            free.add_metric([disk.node.name], disk.free_bytes)
            limit.add_metric([disk.node.name], disk.max_bytes)
        yield from (used, free, limit)

    def _jobs(self) -> Iterator[Metric]:
        for kind, model, statuses in (("download", DownloadJob, DownloadStatus), ("upload", UploadJob, UploadStatus)):
            done = GaugeMetricFamily(f"xgen_{kind}_bytes", f"Bytes moved by {kind} jobs, by status", labels=["status"])
            jobs = GaugeMetricFamily(f"xgen_{kind}_jobs", f"{kind.title()} jobs by status", labels=["status"])
            rows = {r["status"]: r for r in model.objects.values("status").annotate(n=Count("id"), b=Sum("bytes_done"))}
            for status in statuses.values:
                row = rows.get(status, {})
                done.add_metric([status], row.get("b") or 0)
                jobs.add_metric([status], row.get("n") or 0)
            yield from (done, jobs)


_registry = CollectorRegistry(auto_describe=False)
_registry.register(FleetCollector())


def render_fleet() -> bytes:
    """The exposition of the database-backed families (sync: call it through run_db)."""
    return generate_latest(_registry)


__all__ = ["FAMILIES", "FleetCollector", "render_fleet"]
