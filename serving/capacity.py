"""What a node offers to models, what its instances hold, and making room by eviction (issue 13).

One figure per instance (`ModelInstance.memory_mib`) is used for placement, eviction and the API.
A node offers its agent's XGEN_NODE_MEMORY_MIB when set, else its GPUs' memory, else its RAM.
IDLE instances hold nothing. When a start does not fit, the node's unpinned on_demand READY
instances are evicted, least recently used first, until it does: each is sent back to IDLE (its
desired state; the node's supervisor stops it, as for an unload) with the reason in its timeline.
`always` and pinned instances are never evicted.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Sum
from django.utils import timezone

from hardware.models import GpuDevice, Node
from serving.models import ACTIVE_STATES, DesiredState, InstanceEvent, InstanceState, ModelInstance, Policy


@dataclass(frozen=True)
class Holder:
    instance_id: int
    model_name: str
    mib: int
    evictable: bool


class NoRoom(Exception):
    """Nothing can make room: the message has the numbers (needed, free, held by whom)."""

    def __init__(self, message: str, *, need_mib: int, free_mib: int, holders: list[Holder]) -> None:
        super().__init__(message)
        self.message = message
        self.need_mib = need_mib
        self.free_mib = free_mib
        self.holders = holders

    def detail(self) -> dict:
        return {"needed_mib": self.need_mib, "free_mib": self.free_mib,
                "held": [{"instance": h.instance_id, "model": h.model_name, "mib": h.mib, "evictable": h.evictable}
                         for h in self.holders]}


def offered_mib(node: Node) -> int | None:
    """What the node offers to models (None: unknown, so anything fits)."""
    if node.model_memory_mib:
        return int(node.model_memory_mib)
    gpus = GpuDevice.objects.filter(node=node).aggregate(total=Sum("memory_total_mib"))["total"]
    if gpus:
        return int(gpus)
    return int(node.memory_total_mib) or None


def holders(node: Node, *, exclude: int | None = None) -> list[ModelInstance]:
    """The node's instances that hold memory and keep it (running, and not on their way out)."""
    return list(ModelInstance.objects.filter(node=node, state__in=ACTIVE_STATES,
                                             desired_state=DesiredState.RUNNING).exclude(pk=exclude))


def _last_used(inst: ModelInstance):
    return inst.last_request_at or inst.ready_at or inst.created_at


def _evictable(inst: ModelInstance) -> bool:
    return inst.policy == Policy.ON_DEMAND and not inst.pinned and inst.state == InstanceState.READY


def fits_at_all(node: Node, need_mib: int, *, model_name: str) -> None:
    """Refuse a model larger than all its node offers (NoRoom)."""
    offered = offered_mib(node)
    if offered is not None and need_mib > offered:
        raise NoRoom(f"{model_name} needs {need_mib} MiB; {node.name} offers {offered} MiB to models in all",
                     need_mib=need_mib, free_mib=offered, holders=[])


def make_room(node: Node, need_mib: int, *, model_name: str, exclude: int | None = None,
              gpus: list[int] | None = None) -> list[ModelInstance]:
    """Evict what must go for `need_mib` to fit on `node` (call it under the node's placement lock):
    on the GPUs the start will use (`gpus`: their free memory as the detector last saw it, the
    memory of each evicted instance given back to its GPUs), and within what the node offers to
    models. The evicted instances are returned (their desired state is IDLE now; nudge their
    node). Raises NoRoom with the numbers."""
    from serving.placement import gpu_rooms

    node = Node.objects.select_for_update().get(pk=node.pk)  # (PostgreSQL: locked already by placement_lock)
    if need_mib <= 0:
        return []
    held = holders(node, exclude=exclude)
    candidates = sorted((i for i in held if _evictable(i)), key=_last_used)
    victims: list[ModelInstance] = []
    if gpus:
        rooms = {r.index: float(r.free_mib) for r in gpu_rooms(node, exclude_instance=exclude) if r.index in gpus}
        per_gpu = need_mib / len(gpus)
        while any(free < per_gpu for free in rooms.values()):
            short = {i for i, free in rooms.items() if free < per_gpu}
            victim = next((v for v in candidates if v not in victims and short & set(v.gpus or [])), None)
            if victim is None:
                index = min(rooms, key=lambda i: rooms[i])
                _refuse(node, model_name, need_mib, held, f"GPU {index} has {int(rooms[index])} MiB free, "
                                                          f"{int(per_gpu)} MiB needed there", free=int(rooms[index]))
            victims.append(victim)
            for idx in victim.gpus or []:
                if idx in rooms:
                    rooms[idx] += victim.memory_mib / len(victim.gpus)
    offered = offered_mib(node)
    if offered is not None:
        free = offered - sum(i.memory_mib for i in held) + sum(v.memory_mib for v in victims)
        for inst in candidates:
            if free >= need_mib:
                break
            if inst not in victims:
                victims.append(inst)
                free += inst.memory_mib
        if free < need_mib:
            base = offered - sum(i.memory_mib for i in held)
            _refuse(node, model_name, need_mib, held, f"{max(base, 0)} MiB free of {offered} MiB offered to models",
                    free=max(base, 0))
    now = timezone.now()
    for victim in victims:
        reason = f"evicted to make room for {model_name}"
        ModelInstance.objects.filter(pk=victim.pk).update(desired_state=DesiredState.IDLE, state_message=reason,
                                                          updated_at=now)
        InstanceEvent.objects.create(instance=victim, from_state=victim.state, to_state=victim.state,
                                     message=f"{reason} ({need_mib} MiB needed)")
    return victims


def _refuse(node: Node, model_name: str, need_mib: int, held: list[ModelInstance], where: str, *, free: int) -> None:
    summary = [Holder(i.pk, i.model_name, i.memory_mib, _evictable(i)) for i in held]
    who = ", ".join(f"{h.model_name} (instance {h.instance_id}) {h.mib} MiB"
                    f"{'' if h.evictable else ' (pinned or always)'}" for h in summary) or "nothing"
    raise NoRoom(f"{model_name} needs {need_mib} MiB; {node.name} has {where} and nothing more can be evicted "
                 f"(held: {who})", need_mib=need_mib, free_mib=free, holders=summary)
