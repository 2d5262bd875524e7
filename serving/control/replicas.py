"""Replicas of one served name (issue 30): placing more, scaling the count up and down.

One desired count per served name is stored once, in its ModelDeployment row; the instances that
hold the name are its replicas (numbered by `replica`, the lowest free number). Each replica is
planned as a load is (placement, memory estimate, backend verdict, the stored command) and placed
to spread: on a GPU no replica of the model holds (other GPUs of a node that runs it first, then
other nodes); on a CPU node several replicas are separate processes on separate ports, the node
with the fewest replicas first. Every write of a placement is in one transaction under the
placement locks of every node it may use, so a count that does not fit leaves nothing planned.

Scaling down takes the replicas with the fewest requests in flight (those not READY first): each
leaves routing at once (UNLOADING: every web process's routing table drops it on the push), and
its node's supervisor stops it once its requests in flight are done, or at `drain_until`.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import httpx
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from hardware.models import Node
from serving.adapters import ADAPTERS
from serving.control.capacity import NoRoom, fits_at_all, make_room, reported_in_flight
from serving.control.planning import LoadPlan, LoadRefused, plan_replica_on, stored_plan
from serving.control.starts import evict, nudge_node, placement_lock
from serving.models import (
    DesiredState,
    IllegalTransition,
    InstanceState,
    ModelDeployment,
    ModelInstance,
    name_holders,
)

log = logging.getLogger("xgen.serving")

MAX_REPLICAS = 16
DEFAULT_DRAIN_TIMEOUT_S = 30
ENGINE_ASK_TIMEOUT_S = 1.0


@dataclass
class Placed:
    """What a placement of replicas made: the new instances, the refusals of the ones that did not
    fit (node: why), and the instances evicted for them (to nudge once committed)."""

    created: list[ModelInstance] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    victims: list[ModelInstance] = field(default_factory=list)

    def where(self) -> list[dict]:
        return [{"instance": i.pk, "replica": i.replica, "node": i.node.name, "gpus": list(i.gpus or [])}
                for i in self.created]


@contextlib.contextmanager
def placement_locks(node_ids: set[int]) -> Iterator[None]:
    """The placement locks of several nodes, always taken in the same order (no deadlock between
    two placements), and one transaction around them all."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(transaction.atomic())
        for pk in sorted(node_ids):
            stack.enter_context(placement_lock(pk))
        yield


def live_replicas(model_name: str) -> list[ModelInstance]:
    """The replicas that hold the name and are meant to stay (not being scaled down or unloaded)."""
    return list(ModelInstance.objects.select_related("node").filter(name_holders(), model_name=model_name)
                .exclude(desired_state=DesiredState.STOPPED).order_by("replica", "pk"))


def _free_replica_number(model_name: str) -> int:
    taken = set(ModelInstance.objects.filter(name_holders(), model_name=model_name)
                .values_list("replica", flat=True))
    return next(n for n in range(len(taken) + 1) if n not in taken)


def _rank(plan: LoadPlan, on_node: int) -> tuple:
    """Spread: a GPU of a node that runs the model already (another GPU: never one a replica holds),
    then a GPU of another node, then a CPU node, the one with the fewest replicas first."""
    if plan.gpus:
        return (0 if on_node else 1, 0, plan.node.name)
    return (2, on_node, plan.node.name)


def place_replicas(*, first: ModelInstance, count: int, start_now: bool = True, user=None,
                   exclude_nodes: set[int] | frozenset[int] = frozenset()) -> Placed:
    """Plan and record up to `count` more replicas of `first`'s model (call it inside
    placement_locks of every fresh node, in a transaction). Each is planned on every online node
    as a load is, with the backend `first` runs; the best place by _rank is taken, room made there
    by eviction (never of a replica of this model). The ones that fit nowhere are refused, with the
    reason per node. Nothing is announced: the caller does that once committed. `exclude_nodes`:
    nodes not to use (a node the replicas are moved off)."""
    placed = Placed()
    launch = stored_plan(first)
    args = dict(model_path=first.model_path, model_name=first.model_name, server_type=first.type,
                backend=first.backend, gpus=None, tensor_parallel_size=first.tensor_parallel_size,
                extra_args=first.extra_args, adapters=list(first.adapters or []), preset=first.preset)
    nodes = list(Node.placeable().exclude(pk__in=exclude_nodes).order_by("name"))
    for _ in range(count):
        held = ModelInstance.objects.filter(name_holders(), model_name=first.model_name) \
            .exclude(desired_state=DesiredState.STOPPED).values_list("node_id", "gpus")
        on_node: dict[int, int] = {}
        gpus_held: dict[int, set[int]] = {}
        for node_id, gpus in held:
            on_node[node_id] = on_node.get(node_id, 0) + 1
            gpus_held.setdefault(node_id, set()).update(gpus or [])
        options: list[LoadPlan] = []
        why: list[str] = []
        for node in nodes:
            try:
                options.append(plan_replica_on(node, avoid_gpus=frozenset(gpus_held.get(node.pk, ())), **args))
            except LoadRefused as exc:
                if exc.status == 400 and exc.code not in ("backend_unavailable", "does_not_fit"):
                    raise
                why.append(f"{node.name}: {exc.message}")
        options.sort(key=lambda p: _rank(p, on_node.get(p.node.pk, 0)))
        inst = None
        for plan in options:
            try:
                if start_now:
                    placed.victims += make_room(plan.node, plan.estimate.total_mib, model_name=first.model_name,
                                                gpus=list(plan.gpus), basis=_basis(plan))
                else:
                    fits_at_all(plan.node, plan.estimate.total_mib, model_name=first.model_name, basis=_basis(plan))
            except NoRoom as exc:
                why.append(f"{plan.node.name}: {exc.message}")
                continue
            inst = _record_replica(plan, first=first, fallback=bool(launch and launch.fallback),
                                   start_now=start_now, user=user, on_node=on_node.get(plan.node.pk, 0))
            break
        if inst is None:
            placed.refusals.append("; ".join(why) or "no node agent is online")
            break  # the next one would fit nowhere either
        placed.created.append(inst)
    return placed


def _basis(plan: LoadPlan) -> str:
    measured = plan.estimate.measured
    return (f"{measured} for the same model, backend and context" if measured
            else "the estimate (no measurement of this shape yet)")


def _record_replica(plan: LoadPlan, *, first: ModelInstance, fallback: bool, start_now: bool, user,
                    on_node: int) -> ModelInstance:
    import dataclasses

    launch = dataclasses.replace(plan.launch, fallback=fallback)
    number = _free_replica_number(first.model_name)
    spread = (f"GPU {', '.join(map(str, plan.gpus))} holds no replica of it" if plan.gpus
              else f"{on_node} other replica(s) on this node's CPU")
    return ModelInstance.create_requested(
        message=(f"replica {number} of {first.model_name} requested: {launch.reason}; {launch.fit}; {spread}"
                 f"; memory for the fit check: {plan.estimate.total_mib} MiB, {_basis(plan)}"),
        state=InstanceState.PENDING if start_now else InstanceState.IDLE,
        model_name=first.model_name, replica=number, aliases=list(first.aliases or []),
        adapters=list(first.adapters or []), model_path=plan.source.model_path, artifact=plan.source.artifact, type=launch.server_type,
        backend=launch.backend, backend_reason=f"{launch.reason} (replica {number}, {spread}, on {plan.node.name})",
        node=plan.node, gpus=plan.gpus if start_now else [], tensor_parallel_size=launch.tensor_parallel_size,
        extra_args=plan.extra_args, plan=launch.to_json(), autostart=first.autostart,
        desired_state=DesiredState.RUNNING if start_now else DesiredState.IDLE,
        state_message="waiting for the node agent" if start_now else "idle: starts on the first request",
        estimated_memory_mib=plan.estimate.total_mib, created_by=user if getattr(user, "pk", None) else None,
        policy=first.policy, pinned=first.pinned, max_concurrency=first.max_concurrency,
        first_byte_timeout_s=first.first_byte_timeout_s, idle_ttl_s=first.idle_ttl_s, announce=False,
    )


def does_not_fit(model_name: str, *, wanted: int, current: int, placed: Placed) -> LoadRefused:
    """409 does_not_fit with the numbers: how many fit, where, and why not the rest."""
    fit = current + len(placed.created)
    refused = LoadRefused(409, f"{wanted} replicas of {model_name} do not fit: {fit} fit "
                               f"({current} running, {len(placed.created)} more could be placed); "
                               f"{'; '.join(placed.refusals)}. Ask for {fit} or send \"partial\": true.",
                          code="does_not_fit")
    refused.detail = {"wanted": wanted, "running": current, "fit": fit, "could_place": placed.where(),
                      "refused": placed.refusals}
    return refused


def set_desired(model_name: str, replicas: int, *, drain_timeout_s: int | None = None) -> ModelDeployment:
    """The served name's desired count (its row made on the first load)."""
    deployment, made = ModelDeployment.objects.get_or_create(model_name=model_name, defaults={"replicas": replicas})
    if made or deployment.replicas != replicas:  # the autoscaler waits a window after any change
        deployment.last_scaled_at = timezone.now()
    deployment.replicas = replicas
    if drain_timeout_s is not None:
        deployment.drain_timeout_s = drain_timeout_s
    deployment.updated_at = timezone.now()
    deployment.save()
    return deployment


@dataclass
class Scaled:
    """What a scale did: the desired count before and after, the replicas started and draining."""

    model_name: str
    previous: int
    replicas: int
    wanted: int
    started: list[ModelInstance] = field(default_factory=list)
    draining: list[ModelInstance] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        return self.replicas < self.wanted


def engine_in_flight(inst: ModelInstance) -> int | None:
    """The requests the replica's engine says it is answering (llama-server's /slots, vLLM's
    /metrics); None when it cannot say."""
    adapter = ADAPTERS.get(inst.backend)
    if adapter is None or not adapter.busy_path or inst.state != InstanceState.READY or not inst.port:
        return None
    headers = {"Authorization": f"Bearer {inst.backend_key}"} if inst.backend_key else {}
    try:
        r = httpx.get(f"{inst.upstream_base}{adapter.busy_path}", headers=headers, timeout=ENGINE_ASK_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    return adapter.requests_in_flight(r.content) if r.status_code == 200 else None


def request_scale(*, model_name: str, replicas: int, partial: bool = False, drain_timeout_s: int | None = None,
                  user=None, in_flight: Mapping[int, int] | None = None) -> Scaled:
    """Change the served name's replica count (a READY, IDLE or loading model). Up: the new ones
    planned and placed as loads (409 does_not_fit with the numbers when they do not all fit, and
    nothing recorded; `partial`: as many as fit). Down: the replicas with the fewest requests in
    flight (`in_flight`: this web process's counts, added to what each engine says) leave routing
    now and are stopped once drained (`drain_timeout_s`, else the model's)."""
    if not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS:
        raise LoadRefused(400, f"replicas must be 1..{MAX_REPLICAS} (0: unload the model)")
    if drain_timeout_s is not None and not 0 <= drain_timeout_s <= 3600:
        raise LoadRefused(400, "drain_timeout_s must be 0..3600")
    live = live_replicas(model_name)
    if not live:
        raise LoadRefused(404, f"no model {model_name[:120]!r} is loaded (READY, IDLE or loading)",
                          code="model_not_found")
    current = len(live)
    result = Scaled(model_name=model_name, previous=current, replicas=current, wanted=replicas)
    if replicas > current:
        node_ids = set(Node.fresh().values_list("pk", flat=True)) | {i.node_id for i in live}
        with placement_locks(node_ids):
            placed = place_replicas(first=live[0], count=replicas - current, user=user)
            if len(placed.created) < replicas - current and not partial:
                raise does_not_fit(model_name, wanted=replicas, current=current, placed=placed)
            set_desired(model_name, current + len(placed.created), drain_timeout_s=drain_timeout_s)
        for inst in placed.created:
            inst.announce_created()
        if placed.victims:
            evict(placed.victims)
        for node_name in {i.node.name for i in placed.created}:
            nudge_node(node_name)
        result.started, result.refusals = placed.created, placed.refusals
        result.replicas = current + len(placed.created)
        return result
    deployment = set_desired(model_name, replicas, drain_timeout_s=drain_timeout_s)
    if replicas == current:
        return result
    counts = dict(in_flight or {})
    reported = reported_in_flight([i.pk for i in live], model_name)  # every web process's, this one's included

    def busy(inst: ModelInstance) -> int:
        return max(counts.get(inst.pk, 0), reported.get(inst.pk, 0)) + (engine_in_flight(inst) or 0)

    # Not READY first (they serve nothing), then the fewest in flight, then the highest number.
    order = sorted(live, key=lambda i: (i.state == InstanceState.READY, busy(i) if i.state == InstanceState.READY
                                        else 0, -i.replica))
    timeout = deployment.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
    for inst in order[:current - replicas]:
        drain_replica(inst, timeout_s=timeout, reason=f"scaled down from {current} to {replicas} replicas")
        result.draining.append(inst)
    result.replicas = replicas
    return result


def drain_replica(inst: ModelInstance, *, timeout_s: int, reason: str) -> None:
    """Take one replica out: desired STOPPED with a drain deadline, out of routing at once (READY ->
    UNLOADING, pushed to every routing table); the node's supervisor stops it when its requests in
    flight are done or at the deadline. One that serves nothing is stopped now."""
    until = timezone.now() + timedelta(seconds=timeout_s)
    ModelInstance.objects.filter(pk=inst.pk).update(desired_state=DesiredState.STOPPED, autostart=False,
                                                    drain_until=until)
    inst.refresh_from_db()
    try:
        if inst.state == InstanceState.READY:
            inst.mark_unloading(f"{reason}: out of routing, finishing its requests in flight (at most {timeout_s} s)")
        elif inst.state in (InstanceState.ERROR, InstanceState.IDLE) or (
                inst.state == InstanceState.PENDING and not inst.pid):
            inst.mark_stopped(reason)
    except IllegalTransition:  # the agent moved it meanwhile; it stops it now
        inst.refresh_from_db()
    nudge_node(inst.node.name)


def unload_all(model_name: str) -> list[ModelInstance]:
    """Every replica of the served name desired STOPPED (Unload stops all); the desired count 0."""
    rows = list(ModelInstance.objects.select_related("node").filter(model_name=model_name).filter(
        Q(desired_state=DesiredState.RUNNING) | Q(desired_state=DesiredState.IDLE) | Q(state__in=(
            InstanceState.PENDING, InstanceState.CACHING, InstanceState.LOADING, InstanceState.WARMING,
            InstanceState.READY, InstanceState.IDLE))))
    ModelDeployment.objects.filter(model_name=model_name).update(replicas=0, updated_at=timezone.now())
    return rows
