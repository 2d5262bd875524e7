"""Requests on model instances (web side): load, unload, restart, and finding one.

The database holds the desired state; the node agent's supervisor reconciles it. A request only
validates (serving.control.planning makes the load decision, once), writes the row, and nudges the agent
of the instance's node. State changes themselves are ModelInstance's `mark_*` methods.
"""
from __future__ import annotations

import dataclasses
import logging
import re

from django.conf import settings
from django.db import IntegrityError
from django.db.models import Q

from hardware.models import Node
from serving.control import presets
from serving.control.capacity import NoRoom, fits_at_all, make_room, record_refusal
from serving.control.planning import LoadRefused, plan_load
from serving.control.replicas import (
    DEFAULT_DRAIN_TIMEOUT_S,
    MAX_REPLICAS,
    Placed,
    does_not_fit,
    place_replicas,
    placement_locks,
    set_desired,
    unload_all,
)
from serving.control.starts import checked_start, evict, nudge_node, placement_lock, start_again, start_idle
from serving.models import (
    ACTIVE_STATES,
    DesiredState,
    IllegalTransition,
    InstanceState,
    ModelInstance,
    Policy,
    name_holders,
)

log = logging.getLogger("xgen.serving")

__all__ = ["LoadRefused", "find_instance", "instances_for_node", "name_holders", "nudge_node", "request_cold_start",
           "request_load", "request_restart", "request_start", "request_unload", "save_log_tail", "start_again"]

request_cold_start = start_idle  # the command's name for the same desired-state write


def _duplicate(names: str | list[str], *, exclude: int | None = None, replicas_ok: bool = False
               ) -> LoadRefused | None:
    """The refusal for a served name (the first of `names`) or alias another instance holds as its name
    or an alias, or None when all are free: one query for the whole check. `replicas_ok`: the other
    replicas of the name are no clash (a replica started again)."""
    names = [names] if isinstance(names, str) else names
    wanted = set(names)
    holders = ModelInstance.objects.filter(name_holders()).exclude(pk=exclude)
    if replicas_ok:
        holders = holders.exclude(model_name=names[0])
    holders = holders.values_list("pk", "model_name", "aliases", "state", "adapters")
    for pk, name, aliases, state, adapters in holders:
        served_adapters = [f"{name}:{a['name']}" for a in adapters or [] if isinstance(a, dict) and "name" in a]
        taken = wanted & {name, *(aliases or []), *served_adapters}
        if not taken:
            continue
        if name == names[0]:
            return LoadRefused(409, f"a model named {name!r} is already loaded (instance {pk}, {state}); unload it "
                                    "or pick another model_name", code="duplicate_model_name")
        return LoadRefused(409, f"{sorted(taken)[0]!r} is already a name or alias of instance {pk} ({state}); "
                                "unload it or pick another name", code="duplicate_model_name")
    return None


ALIAS_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+\-]{0,127}")


def check_aliases(aliases: list[str] | None, model_name: str) -> list[str]:
    """The load's aliases, checked (names a client can put in `model`) and without repeats."""
    out: list[str] = []
    for alias in aliases or []:
        if not isinstance(alias, str) or not ALIAS_RE.fullmatch(alias):
            raise LoadRefused(400, f"alias {str(alias)[:80]!r} is not a model name (letters, digits, ._:/@+-; "
                                   "at most 128)", code="invalid_request")
        if alias != model_name and alias not in out:
            out.append(alias)
    return out


def _no_room(exc: NoRoom) -> LoadRefused:
    refused = LoadRefused(409, exc.message, code="does_not_fit")
    refused.detail = exc.detail()
    return refused


def request_load(*, model_path: str, model_name: str | None = None, server_type: str = "llm",
                 backend: str | None = None, node: str | None = None, gpus: list[int] | None = None,
                 tensor_parallel_size: int | None = None, extra_args: dict | None = None,
                 autostart: bool = False, user=None, aliases: list[str] | None = None,
                 fallback: bool | None = None, policy: str = Policy.ALWAYS, idle_ttl_s: int | None = None,
                 pinned: bool = False, max_concurrency: int | None = None,
                 start: bool | None = None, first_byte_timeout_s: int | None = None, replicas: int = 1,
                 partial: bool = False, drain_timeout_s: int | None = None,
                 adapters: list | None = None, preset: str | None = None) -> ModelInstance:
    """Plan and record a load, then nudge the node's agent. `always` (and an on_demand load with
    `start`): desired RUNNING, state PENDING, room made by eviction (409 does_not_fit when none
    can be). on_demand without `start`: IDLE, started by the first request.

    `fallback`: may the agent try another backend of the node when this one does not come up?
    None: yes for a backend chosen automatically, no for one asked for by name.

    The plan is made twice: first to pick the node (every node, no lock), then again on that node
    under its placement lock, where the GPU rooms read count every load committed before.

    `replicas` (issue 30): replica 0 is this load; the others are planned and placed as loads are
    (serving.control.replicas), all in one transaction under every online node's placement lock:
    409 does_not_fit with the numbers when they do not all fit and nothing recorded, or with
    `partial` as many as fit (the instance's `placed` says which).

    `preset` (issue 27 #3): the model's engine preset of that name (None: its default one, if any;
    "none": no preset); 404 preset_not_found for a name the model has none of."""
    if not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS:
        raise LoadRefused(400, f"replicas must be 1..{MAX_REPLICAS}")
    if replicas > 1 and gpus:
        raise LoadRefused(400, "gpus places one replica; leave it out with replicas > 1 (each replica gets GPUs "
                               "no other replica holds)")
    if policy not in Policy.values:
        raise LoadRefused(400, f"policy must be always or on_demand, not {str(policy)[:40]!r}")
    if idle_ttl_s is not None and idle_ttl_s < 0:
        raise LoadRefused(400, "idle_ttl_s must be >= 0 (0: never unloaded for idleness)")
    if max_concurrency is not None and max_concurrency < 1:
        raise LoadRefused(400, "max_concurrency must be >= 1 (or null: no limit)")
    if first_byte_timeout_s is not None and first_byte_timeout_s < 1:
        raise LoadRefused(400, "first_byte_timeout_s must be >= 1 (or null: the proxy's setting)")
    on_demand = policy == Policy.ON_DEMAND
    start_now = (not on_demand) if start is None else (bool(start) or not on_demand)
    try:
        chosen_preset = presets.find(presets.normalize_model_path(model_path), preset)
    except presets.PresetInvalid:
        chosen_preset = None  # a model_path planning refuses, with its own words
    except LookupError as exc:
        raise LoadRefused(404, str(exc), code="preset_not_found") from None
    args = dict(model_path=model_path, model_name=model_name, server_type=server_type, backend=backend, gpus=gpus,
                tensor_parallel_size=tensor_parallel_size, extra_args=extra_args, adapters=adapters,
                preset=presets.snapshot(chosen_preset) if chosen_preset else None)
    plan = plan_load(node=node, **args)
    aliases = check_aliases(aliases, plan.model_name)
    victims: list[ModelInstance] = []
    placed = Placed()
    on_demand_fields = dict(policy=policy, pinned=pinned, max_concurrency=max_concurrency,
                            first_byte_timeout_s=first_byte_timeout_s,
                            idle_ttl_s=(settings.IDLE_TTL_S if idle_ttl_s is None else idle_ttl_s) if on_demand else 0)
    lock = placement_lock(plan.node.pk) if replicas == 1 else placement_locks(
        {plan.node.pk, *Node.fresh().values_list("pk", flat=True)})
    try:
        with lock:
            if plan.gpus:  # GPU memory is booked: read the rooms again, under the lock
                plan = dataclasses.replace(plan_load(again=plan, **args), placement=plan.placement)
            may_fall_back = fallback if fallback is not None else backend in (None, "", "auto")
            plan = dataclasses.replace(plan, launch=dataclasses.replace(plan.launch, fallback=bool(may_fall_back)))
            basis = _plan_basis(plan)
            if start_now:
                victims = make_room(plan.node, plan.estimate.total_mib, model_name=plan.model_name,
                                    gpus=list(plan.gpus), basis=basis)
            else:
                fits_at_all(plan.node, plan.estimate.total_mib, model_name=plan.model_name, basis=basis)
            inst = _record_load(plan, aliases=aliases, autostart=autostart, user=user, start_now=start_now,
                                **on_demand_fields)
            if replicas > 1:
                placed = place_replicas(first=inst, count=replicas - 1, start_now=start_now, user=user)
                if len(placed.created) < replicas - 1 and not partial:
                    raise does_not_fit(plan.model_name, wanted=replicas, current=1, placed=placed)
            set_desired(plan.model_name, 1 + len(placed.created),
                        drain_timeout_s=DEFAULT_DRAIN_TIMEOUT_S if drain_timeout_s is None else drain_timeout_s)
    except NoRoom as exc:
        raise _no_room(exc) from None
    except IntegrityError:
        # A load for the same name won the race between the name check and this insert.
        clash = _duplicate(plan.model_name)
        if clash is None:
            raise
        raise clash from None
    inst.announce_created()
    for replica in placed.created:
        replica.announce_created()
    victims += placed.victims
    if victims:
        evict(victims)
    if start_now:
        for node_name in {plan.node.name, *(r.node.name for r in placed.created)}:
            nudge_node(node_name)
    inst.placed = [inst, *placed.created]  # type: ignore[attr-defined]
    inst.replicas_wanted, inst.refusals = replicas, placed.refusals  # type: ignore[attr-defined]
    return inst


def _plan_basis(plan) -> str:
    """Where a new load's figure came from (its plan took the shape's measurement when one was recorded)."""
    measured = plan.estimate.measured
    return (f"{measured} for the same model, backend and context" if measured
            else "the estimate (no measurement of this shape yet)")


def _record_load(plan, *, aliases: list[str], autostart: bool, user, start_now: bool = True,
                 **on_demand_fields) -> ModelInstance:
    served_adapters = [f"{plan.model_name}:{a['name']}" for a in plan.launch.adapters]
    clash = _duplicate([plan.model_name, *aliases, *served_adapters])
    if clash is not None:
        raise clash
    launch = plan.launch
    return ModelInstance.create_requested(
        message=(f"load requested: {launch.reason}; {launch.fit}" if start_now else
                 f"registered on_demand: {launch.reason}; {launch.fit}; starts on the first request")
        + f"; memory for the fit check: {plan.estimate.total_mib} MiB, {_plan_basis(plan)}",
        state=InstanceState.PENDING if start_now else InstanceState.IDLE,
        model_name=plan.model_name, aliases=aliases, model_path=plan.source.model_path,
        artifact=plan.source.artifact, adapters=[dict(a) for a in plan.launch.adapters],
        type=launch.server_type, backend=launch.backend, backend_reason=f"{launch.reason} ({plan.placement})",
        node=plan.node, gpus=plan.gpus if start_now else [], tensor_parallel_size=launch.tensor_parallel_size,
        extra_args=plan.extra_args, plan=launch.to_json(), autostart=autostart,
        preset={"name": launch.preset["name"], "settings": launch.preset["settings"]} if launch.preset else None,
        desired_state=DesiredState.RUNNING if start_now else DesiredState.IDLE,
        state_message="waiting for the node agent" if start_now else "idle: starts on the first request",
        estimated_memory_mib=plan.estimate.total_mib, created_by=user if getattr(user, "pk", None) else None,
        announce=False, **on_demand_fields,
    )


def request_start(*, instance: ModelInstance) -> ModelInstance:
    """The Start button of an IDLE instance (409 does_not_fit when nothing can make room)."""
    if instance.state != InstanceState.IDLE:
        raise LoadRefused(409, f"instance {instance.pk} is {instance.state}, not IDLE", code="not_idle")
    try:
        return start_idle(instance_id=instance.pk, reason="start requested", spare_recent=False)
    except NoRoom as exc:
        raise _no_room(exc) from None


def find_instance(*, id: int | None = None, model_name: str | None = None) -> ModelInstance:
    """The instance by id, or the active one serving `model_name`."""
    qs = ModelInstance.objects.select_related("node")
    if id is not None:
        inst = qs.filter(pk=id).first()
        if inst is None:
            raise LoadRefused(404, f"no instance {id}", code="instance_not_found")
        return inst
    if model_name:
        inst = qs.filter(model_name=model_name, state__in=(*ACTIVE_STATES, InstanceState.IDLE)).first() or \
            qs.filter(model_name=model_name).first()
        if inst is None:
            raise LoadRefused(404, f"no instance serves {model_name[:120]!r}", code="model_not_found")
        return inst
    raise LoadRefused(400, "give id or model_name")


def request_unload(*, instance: ModelInstance) -> ModelInstance:
    """Desired STOPPED for the instance and every other replica of its served name (Unload stops
    all; the desired count becomes 0); the agents stop the processes (an instance not running is
    marked STOPPED now)."""
    others = [r for r in unload_all(instance.model_name) if r.pk != instance.pk]
    for inst in [instance, *others]:
        _unload_one(inst)
    return instance


def _unload_one(instance: ModelInstance) -> None:
    ModelInstance.objects.filter(pk=instance.pk).update(desired_state=DesiredState.STOPPED, autostart=False)
    instance.refresh_from_db()
    if instance.state in (InstanceState.ERROR, InstanceState.IDLE) or (
            instance.state == InstanceState.PENDING and not instance.pid):
        try:
            instance.mark_stopped("unloaded")
        except IllegalTransition:  # the agent moved it meanwhile; it stops it now
            instance.refresh_from_db()
    nudge_node(instance.node.name)


def request_restart(*, instance: ModelInstance) -> ModelInstance:
    """Stop (if running) and start again; an ERROR or STOPPED instance is started afresh (an
    IDLE one is started, as by a request)."""
    if instance.state == InstanceState.IDLE:
        return request_start(instance=instance)
    if instance.state in (InstanceState.STOPPED, InstanceState.ERROR):
        clash = _duplicate(instance.model_name, exclude=instance.pk, replicas_ok=True)
        if clash is not None:
            raise LoadRefused(409, f"another instance now serves {instance.model_name!r}",
                              code="duplicate_model_name")
        victims: list[ModelInstance] = []
        try:
            with placement_lock(instance.node_id):
                victims = checked_start(instance, "restart requested", desired_state=DesiredState.RUNNING,
                                         restarts=0, last_error="", exit_code=None)
        except NoRoom as exc:
            record_refusal(instance.pk, exc)
            raise _no_room(exc) from None
        except IntegrityError:
            raise LoadRefused(409, f"another instance now serves {instance.model_name!r}",
                              code="duplicate_model_name") from None
        except IllegalTransition:  # it left STOPPED/ERROR meanwhile: restart what runs
            instance.note_restart_requested()
        if victims:
            evict(victims)
    else:
        instance.note_restart_requested()
    nudge_node(instance.node.name)
    return instance


def instances_for_node(node_name: str) -> list[ModelInstance]:
    return list(ModelInstance.objects.select_related("node").filter(node__name=node_name).filter(
        Q(desired_state=DesiredState.RUNNING) | Q(state__in=ACTIVE_STATES) | Q(pid__isnull=False)))


def save_log_tail(instance_id: int, lines: list[str]) -> None:
    ModelInstance.objects.filter(pk=instance_id).update(log_tail=lines[-50:])
