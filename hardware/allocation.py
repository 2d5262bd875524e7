"""The GPU allocation overview: which node has which GPUs, how full they are, and who holds them.

Read-only; the GPUs page, its live fragments and the hardware API share it. Who holds a GPU
is serving's knowledge: serving hands in a holder source at start-up (`set_holder_source`),
so hardware, the bottom tier, never imports it. So is which instances a user may see: a team lead
below operator sees only the GPUs its teams' models hold (issue 26 #4), through the visibility
source serving hands in (`set_visibility_source`); everyone else sees every GPU.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.urls import reverse

from hardware.models import GpuDevice, Node


@dataclass
class Holder:
    id: int
    model_name: str
    state: str
    memory_mib: int = 0  # what the instance booked on each GPU it holds


def _whole(value: float | None) -> str | None:
    """A percentage or temperature as the page shows it (floatformat:0 rounds half up)."""
    return None if value is None else str(int(value + 0.5) if value >= 0 else round(value))


@dataclass
class GpuRow:
    """One GPU and its holder; `cells` is what the GPUs page prints of it, formatted once and held
    in a dict: 160 rows through the template's attribute lookups and filters (floatformat,
    widthratio, number localization) took 88 ms of that page (bench/pages.py), and a dict is the
    one lookup Django's templates try first."""
    gpu: GpuDevice
    holder: Holder | None
    cells: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        g, h = self.gpu, self.holder
        self.cells = {
            "row_id": f"gpu-{g.node_id}-{g.index}", "index": str(g.index), "name": g.name,
            "kind": f"{g.vendor} {g.arch}", "type": g.type,
            "memory": f"{g.memory_used_mib} / {g.memory_total_mib} MiB", "used_pct": _whole(g.memory_used_pct),
            "utilization": _whole(g.utilization_pct), "temperature": _whole(g.temperature_c),
            "holder": None if h is None else {"name": h.model_name, "state": h.state,
                                              "url": reverse("instance-detail", args=[h.id])},
        }


@dataclass
class NodeCard:
    node: Node
    gpus: list[GpuRow]
    status: str
    gpu_memory_total_mib: int = 0
    gpu_memory_free_mib: int = 0

    @property
    def ram_free_mib(self) -> int:
        return max(0, self.node.memory_total_mib - self.node.memory_used_mib)

    @property
    def ram_used_pct(self) -> float:
        total = self.node.memory_total_mib
        return 100.0 * self.node.memory_used_mib / total if total else 0.0

    @property
    def failed_attempts(self) -> list[dict[str, Any]]:
        return [a for a in self.node.detection_report if not a.get("ok")]


@dataclass
class Overview:
    cards: list[NodeCard] = field(default_factory=list)
    instances_active: int = 0

    @property
    def node_count(self) -> int:
        return len(self.cards)

    @property
    def gpu_count(self) -> int:
        return sum(len(c.gpus) for c in self.cards)

    @property
    def online_count(self) -> int:
        return sum(1 for c in self.cards if c.status == "online")


# Every active instance (of one node, or of all): (node id, GPU indexes it holds, who it is).
HolderSource = Callable[[Node | None], list[tuple[int, list[int], Holder]]]
_holder_source: HolderSource | None = None


def set_holder_source(source: HolderSource) -> None:
    """Register who answers "which instances are active, and which GPUs do they hold"."""
    global _holder_source
    _holder_source = source


# The ids of the instances whose GPUs a user may see, or None: every GPU.
VisibilitySource = Callable[[Any], set[int] | None]
_visibility_source: VisibilitySource | None = None


def set_visibility_source(source: VisibilitySource) -> None:
    """Register who answers "which instances' GPUs may this user see" (None: all)."""
    global _visibility_source
    _visibility_source = source


def visible_instances(user: Any) -> set[int] | None:
    """The instances whose GPUs `user` may see on the GPU pages and API; None: every GPU."""
    return _visibility_source(user) if _visibility_source is not None else None


def _holders_by_node(node: Node | None = None, visible: set[int] | None = None
                     ) -> tuple[dict[int, dict[int, Holder]], int]:
    """node id -> GPU index -> holder, and how many instances are active (of `visible` only, if given)."""
    active = _holder_source(node) if _holder_source is not None else []
    if visible is not None:
        active = [a for a in active if a[2].id in visible]
    by_node: dict[int, dict[int, Holder]] = {}
    for node_id, gpus, holder in active:
        for index in gpus:
            by_node.setdefault(node_id, {})[int(index)] = holder
    return by_node, len(active)


def gpu_holders(node: Node) -> dict[int, Holder]:
    """GPU index -> the active instance holding it, for one node."""
    return _holders_by_node(node)[0].get(node.pk, {})


def node_card(node: Node, holders: dict[int, Holder] | None = None, *, visible: set[int] | None = None) -> NodeCard:
    """One node's card: its GPUs with holders and free memory (`visible`: only the GPUs these
    instances hold)."""
    if holders is None:
        holders = _holders_by_node(node, visible)[0].get(node.pk, {})
    rows = [GpuRow(gpu=g, holder=holders.get(g.index)) for g in node.gpus.all()
            if visible is None or g.index in holders]
    return NodeCard(
        node=node,
        gpus=rows,
        status=node.status,
        gpu_memory_total_mib=sum(r.gpu.memory_total_mib for r in rows),
        gpu_memory_free_mib=sum(r.gpu.memory_free_mib for r in rows),
    )


def overview(visible: set[int] | None = None) -> Overview:
    """Every node's card and the count of active instances, in three queries whatever the cluster
    size; `visible`: only the nodes and GPUs these instances hold (a team lead's view)."""
    by_node, active = _holders_by_node(None, visible)
    nodes = Node.objects.prefetch_related("gpus")
    if visible is not None:
        nodes = nodes.filter(pk__in=list(by_node))
    cards = [node_card(node, by_node.get(node.pk, {}), visible=visible) for node in nodes]
    return Overview(cards=cards, instances_active=active)
