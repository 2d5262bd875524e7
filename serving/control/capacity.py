"""What a node offers to models, what its instances hold, and making room by eviction (issue 13).

One figure per instance (`ModelInstance.memory_mib`) is used for placement, eviction and the API.
A node offers its agent's XGEN_NODE_MEMORY_MIB when set, else its GPUs' memory, else its RAM.
IDLE instances hold nothing. When a start does not fit, the node's unpinned on_demand READY
instances are evicted, least recently used first, until it does: each is sent back to IDLE (its
desired state; the node's supervisor stops it, as for an unload) with the reason in its timeline.
`always` and pinned instances are never evicted, and a start asked for by a request (a cold start:
any key's, a viewer's too) never evicts a model used or started within XGEN_EVICT_GRACE_S (the
proxy writes an instance with requests in flight as used every second), so one team's request
cannot stop a model another team is using: it is refused 503 insufficient_capacity instead.

Every start (a request's cold start, the Start button, a clicked load, a restart, an autostart)
checks the fit with the best figure known for the instance's shape at that moment
(`start_memory`): its own measurement, else the one recorded for the same model, backend,
context and tensor parallel size by another instance, else the estimate; the refusal and the
timeline say which.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db.models import Sum
from django.utils import timezone

from hardware.models import GpuDevice, Node
from serving.models import (
    ACTIVE_STATES,
    DesiredState,
    InFlightReport,
    InstanceEvent,
    InstanceState,
    ModelInstance,
    Policy,
)


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


@dataclass(frozen=True)
class StartMemory:
    """The figure a start is checked with, and where it came from (for the refusal and the timeline)."""

    mib: int
    source: str  # "measured" (its own), "shape" (another instance of its shape), "estimate"
    basis: str  # "measured by this instance", "measured for the same model, backend and context on node-a, ..."

    @property
    def note(self) -> str:
        """The timeline's words: "memory for the fit check: 81 MiB, measured ..."."""
        return f"memory for the fit check: {self.mib} MiB, {self.basis}"


def start_memory(inst: ModelInstance) -> StartMemory:
    """The best figure known now for what `inst` will hold once started: its own measurement, else
    the measurement of its load shape (model, backend and flavour, context, tensor parallel size)
    recorded by another instance, else its estimate."""
    from django.utils.timesince import timesince

    from serving.control.planning import plan_ctx, stored_plan
    from serving.models import MemoryMeasurement

    estimate = int(inst.estimated_memory_mib or 0)
    if inst.measured_memory_mib:
        return StartMemory(int(inst.measured_memory_mib), "measured",
                           f"measured by this instance ({inst.measured_source or 'memory'}); estimate {estimate} MiB")
    plan = stored_plan(inst)
    if plan is not None:
        m = MemoryMeasurement.objects.filter(
            model_path=plan.model_path, backend=f"{plan.backend} ({plan.flavour})", ctx=plan_ctx(plan, inst.extra_args),
            tensor_parallel_size=plan.tensor_parallel_size).first()
        if m is not None:
            ago = timesince(m.measured_at).split(",")[0]
            return StartMemory(int(m.measured_mib), "shape",
                               f"measured for the same model, backend and context on {m.node_name}, {ago} ago "
                               f"({m.source}); estimate {estimate} MiB")
    return StartMemory(estimate, "estimate", "the estimate (no measurement of this shape yet)")


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


def report_fresh_s() -> float:
    """How old a web process's InFlightReport may be and still count: three of its flushes and
    some slack (a process that died stops counting after that)."""
    return 3 * settings.ACTIVITY_FLUSH_S + 2


def reported_in_flight(instance_ids: list[int], model_name: str) -> dict[int, int]:
    """Requests in flight per instance, summed over the web processes' fresh reports."""
    fresh = timezone.now() - timedelta(seconds=report_fresh_s())
    out: dict[int, int] = {}
    wanted = {str(pk) for pk in instance_ids}
    for per in InFlightReport.objects.filter(model_name=model_name, at__gte=fresh).values_list("instances", flat=True):
        for key, count in (per or {}).items():
            if key in wanted and isinstance(count, int):
                out[int(key)] = out.get(int(key), 0) + count
    return out


def has_requests_in_flight(inst: ModelInstance) -> bool:
    """Whether a web process reports requests in flight on `inst` now."""
    return reported_in_flight([inst.pk], inst.model_name).get(inst.pk, 0) > 0


def _evictable(inst: ModelInstance, spare_since=None) -> bool:
    """Whether a start may evict `inst`; `spare_since`: not if used (or started) since then. Never
    a pinned model (not one replica of it), never a replica with requests in flight (issue 30 #3)."""
    return inst.policy == Policy.ON_DEMAND and not inst.pinned and inst.state == InstanceState.READY \
        and (spare_since is None or _last_used(inst) < spare_since) and not has_requests_in_flight(inst)


def _basis(need_mib: int, basis: str) -> str:
    return f"; {need_mib} MiB is {basis}" if basis else ""


def fits_at_all(node: Node, need_mib: int, *, model_name: str, basis: str = "") -> None:
    """Refuse a model larger than all its node offers (NoRoom); `basis` says where `need_mib` came from."""
    offered = offered_mib(node)
    if offered is not None and need_mib > offered:
        raise NoRoom(f"{model_name} needs {need_mib} MiB; {node.name} offers {offered} MiB to models in all"
                     f"{_basis(need_mib, basis)}", need_mib=need_mib, free_mib=offered, holders=[])


def make_room(node: Node, need_mib: int, *, model_name: str, exclude: int | None = None,
              gpus: list[int] | None = None, basis: str = "", spare_recent: bool = False) -> list[ModelInstance]:
    """Evict what must go for `need_mib` to fit on `node` (call it under the node's placement lock):
    on the GPUs the start will use (`gpus`: their free memory as the detector last saw it, the
    memory of each evicted instance given back to its GPUs), and within what the node offers to
    models. The evicted instances are returned (their desired state is IDLE now; nudge their
    node). Raises NoRoom with the numbers (and `basis`: where `need_mib` came from). `spare_recent`
    (a cold start asked for by a request): models used or started within XGEN_EVICT_GRACE_S stay."""
    from serving.control.placement import gpu_rooms

    node = Node.objects.select_for_update().get(pk=node.pk)  # (PostgreSQL: locked already by placement_lock)
    if need_mib <= 0:
        return []
    held = holders(node, exclude=exclude)  # every replica of every model counts, each its own row
    spare_since = timezone.now() - timedelta(seconds=settings.EVICT_GRACE_S) if spare_recent else None
    # A replica of the model being started is never evicted for it (that would only move it).
    candidates = sorted((i for i in held if _evictable(i, spare_since) and i.model_name != model_name),
                        key=_last_used)
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
                                                          f"{int(per_gpu)} MiB needed there", free=int(rooms[index]),
                        basis=basis, spare_since=spare_since)
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
                    free=max(base, 0), basis=basis, spare_since=spare_since)
    now = timezone.now()
    for victim in victims:
        reason = f"evicted to make room for {model_name}"
        ModelInstance.objects.filter(pk=victim.pk).update(desired_state=DesiredState.IDLE, state_message=reason,
                                                          updated_at=now)
        InstanceEvent.objects.create(instance=victim, from_state=victim.state, to_state=victim.state,
                                     message=f"{reason} ({need_mib} MiB needed)")
    return victims


def record_refusal(instance_id: int, exc: NoRoom) -> None:
    """A refused start in the instance's timeline, once however many requests are refused alike."""
    message = f"start refused: {exc.message}"
    inst = ModelInstance.objects.filter(pk=instance_id).only("state").first()
    last = InstanceEvent.objects.filter(instance_id=instance_id).order_by("-at", "-pk") \
        .values_list("message", flat=True).first()
    if inst is not None and last != message:
        InstanceEvent.objects.create(instance=inst, from_state=inst.state, to_state=inst.state, message=message)


def _refuse(node: Node, model_name: str, need_mib: int, held: list[ModelInstance], where: str, *, free: int,
            basis: str = "", spare_since=None) -> None:
    summary = [Holder(i.pk, i.model_name, i.memory_mib, _evictable(i, spare_since)) for i in held]

    def why(inst: ModelInstance) -> str:
        if _evictable(inst, spare_since):
            return ""
        if inst.policy == Policy.ON_DEMAND and not inst.pinned and has_requests_in_flight(inst):
            return " (requests in flight)"
        return f" (in use within {settings.EVICT_GRACE_S} s)" if _evictable(inst) else " (pinned or always)"

    who = ", ".join(f"{i.model_name} (instance {i.pk}) {i.memory_mib} MiB{why(i)}" for i in held) or "nothing"
    raise NoRoom(f"{model_name} needs {need_mib} MiB; {node.name} has {where} and nothing more can be evicted "
                 f"(held: {who}){_basis(need_mib, basis)}", need_mib=need_mib, free_mib=free, holders=summary)
