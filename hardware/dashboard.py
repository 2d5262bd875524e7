"""The dashboard's node panels (per node: its GPUs' memory and utilization, its CPU; a node without
a GPU charts its RAM and CPU) and the node page's per-GPU charts, drawn from history's samples; and the 10 s sample the
node agent takes of its node."""
from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Count, QuerySet, Sum
from django.template.loader import render_to_string
from django.utils.safestring import SafeString

from hardware.allocation import gpu_holders
from hardware.models import Node
from history.charts import line_chart
from history.samples import (
    ALL_GPUS,
    HOST_GPU,
    Range,
    ResourceReading,
    ResourceSeries,
    record_resources,
    resource_series,
)

GIB = 1024.0


def record_node_sample(node_name: str, *, at: float | None = None) -> int:
    """Sample the node's RAM/CPU and each GPU's memory, booking and utilization (as last stored)."""
    node = Node.objects.prefetch_related("gpus").get(name=node_name)
    holders = gpu_holders(node)
    readings = [ResourceReading(gpu=HOST_GPU, mem_used_mib=node.memory_used_mib, mem_total_mib=node.memory_total_mib,
                                util_pct=node.cpu_percent)]
    for g in node.gpus.all():
        holder = holders.get(g.index)
        readings.append(ResourceReading(gpu=g.index, mem_used_mib=g.memory_used_mib, mem_total_mib=g.memory_total_mib,
                                        mem_alloc_mib=holder.memory_mib if holder else 0, util_pct=g.utilization_pct))
    return record_resources(node=node.name, readings=readings, at=at)


@dataclass
class NodePanel:
    node: Node
    status: str
    gpu_count: int
    note: str
    memory_chart: SafeString
    util_chart: SafeString

    @property
    def element_id(self) -> str:
        return f"dash-node-{self.node.pk}"


def _gib(values: list[float | None]) -> list[float | None]:
    return [None if v is None else v / GIB for v in values]


def _with_gpu_totals(nodes: QuerySet) -> QuerySet:
    """Nodes with `gpu_count` and `gpu_total_mib`: counted by the database (loading each node's GPU
    rows for them cost 8 ms of the dashboard with 160 GPUs)."""
    return nodes.annotate(gpu_count=Count("gpus"), gpu_total_mib=Sum("gpus__memory_total_mib"))


def _panel(node: Node, rng: Range, times: list[int], series: dict[tuple[str, int], ResourceSeries]) -> NodePanel:
    """The dashboard's panel (`node` from _with_gpu_totals): the node's GPUs together (memory
    summed, utilization averaged) and its CPU; a node without a GPU charts its RAM and CPU."""
    gpus = node.gpu_count
    base = f"chart-{node.pk}-{rng.name}"
    empty: list[float | None] = [None] * len(times)
    host = series.get((node.name, HOST_GPU))
    cpu = host.util_pct if host else empty
    if gpus:
        both = series.get((node.name, ALL_GPUS))
        total = both.mem_total_mib if both and both.mem_total_mib else node.gpu_total_mib or 0
        mem = {"used": _gib(both.mem_used_mib) if both else empty}
        if both and any(both.mem_alloc_mib):
            mem["booked by instances"] = _gib(both.mem_alloc_mib)
        mem_chart = line_chart(times=times, series=mem, unit="GiB", y_max=total / GIB or None, chart_id=f"{base}-mem",
                               step_s=rng.bucket_s, label=f"{node.name}: GPU memory of its {gpus} GPUs, GiB, last {rng.name}")
        util_chart = line_chart(times=times, series={f"GPUs (mean of {gpus})": both.util_pct if both else empty,
                                                     "CPU": cpu}, unit="%", y_max=100, chart_id=f"{base}-util",
                                step_s=rng.bucket_s, label=f"{node.name}: GPU and CPU utilization, %, last {rng.name}")
        note = ""
    else:
        total = (host.mem_total_mib if host else node.memory_total_mib) / GIB
        mem_chart = line_chart(times=times, series={"RAM used": _gib(host.mem_used_mib) if host else empty},
                               unit="GiB", y_max=total or None, chart_id=f"{base}-mem", step_s=rng.bucket_s,
                               label=f"{node.name}: RAM used, GiB, last {rng.name}")
        util_chart = line_chart(times=times, series={"CPU": cpu}, unit="%", y_max=100,
                                chart_id=f"{base}-util", step_s=rng.bucket_s,
                                label=f"{node.name}: CPU use, %, last {rng.name}")
        note = "No GPU on this node: RAM and CPU shown."
    return NodePanel(node=node, status=node.status, gpu_count=gpus, note=note, memory_chart=mem_chart,
                     util_chart=util_chart)


def gpu_panel(node: Node, rng: Range, *, now: float | None = None, only: set[int] | None = None) -> NodePanel:
    """The node page's panel: memory used and booked, and utilization, per GPU (`only`: these GPU
    indexes)."""
    times, series = resource_series(rng, node=node.name, per_gpu=True, now=now)
    gpus = sorted((g for g in node.gpus.all() if only is None or g.index in only), key=lambda g: g.index)
    if not gpus:
        node.gpu_count, node.gpu_total_mib = 0, 0
        return _panel(node, rng, times, series)
    empty: list[float | None] = [None] * len(times)
    rows = {g.index: series.get((node.name, g.index)) for g in gpus}
    mem: dict[str, list[float | None]] = {}
    for i, s in rows.items():
        mem[f"gpu{i} used"] = _gib(s.mem_used_mib) if s else empty
        if s and any(s.mem_alloc_mib):
            mem[f"gpu{i} booked"] = _gib(s.mem_alloc_mib)
    util = {f"gpu{i}": s.util_pct if s else empty for i, s in rows.items()}
    base = f"chart-gpus-{node.pk}-{rng.name}"
    return NodePanel(
        node=node, status=node.status, gpu_count=len(gpus), note="",
        memory_chart=line_chart(times=times, series=mem, unit="GiB", chart_id=f"{base}-mem", step_s=rng.bucket_s,
                                label=f"{node.name}: memory per GPU, GiB, last {rng.name}"),
        util_chart=line_chart(times=times, series=util, unit="%", y_max=100, chart_id=f"{base}-util",
                              step_s=rng.bucket_s, label=f"{node.name}: utilization per GPU, %, last {rng.name}"))


def node_panels(rng: Range, *, now: float | None = None) -> list[NodePanel]:
    """Every node's panel over `rng` (two queries whatever the fleet's size)."""
    times, series = resource_series(rng, now=now)
    return [_panel(node, rng, times, series) for node in _with_gpu_totals(Node.objects.order_by("name"))]


def render_node_panel(node_name: str, rng: Range) -> tuple[str, str]:
    """(element id, out-of-band html) of one node's panel, for the live dashboard."""
    node = _with_gpu_totals(Node.objects.filter(name=node_name)).get()
    times, series = resource_series(rng, node=node.name)
    panel = _panel(node, rng, times, series)
    html = render_to_string("hardware/partials/_dash_node.html", {"panel": panel, "oob": True})
    return panel.element_id, html
