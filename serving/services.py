"""Requests on model instances (web side): load, unload, restart, and finding one.

The database holds the desired state; the node agent's supervisor reconciles it. A request only
validates (serving.planning makes the load decision, once), writes the row, and nudges the agent
of the instance's node. State changes themselves are ModelInstance's `mark_*` methods.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Q

from live.groups import send_sync
from serving import events
from serving.capacity import NoRoom, fits_at_all, make_room, record_refusal, start_memory
from serving.models import (
    ACTIVE_STATES,
    DesiredState,
    IllegalTransition,
    InstanceState,
    ModelInstance,
    Policy,
    name_holders,
)
from serving.planning import LoadRefused, plan_load, stored_plan

log = logging.getLogger("xgen.serving")

__all__ = ["LoadRefused", "find_instance", "instances_for_node", "name_holders", "nudge_node", "request_cold_start",
           "request_load", "request_restart", "request_start", "request_unload", "save_log_tail", "start_again"]


def nudge_node(node_name: str) -> None:
    """Wake the node's agent now (it would also notice within RECONCILE_INTERVAL_S)."""
    send_sync(events.node_group(node_name), {"type": "agent.nudge"})  # bounded; the agent also reconciles


def _duplicate(model_name: str, *, exclude: int | None = None) -> LoadRefused | None:
    """The refusal for a served name another instance holds, or None when it is free."""
    other = ModelInstance.objects.filter(model_name=model_name).filter(name_holders()).exclude(pk=exclude).first()
    if other is None:
        return None
    return LoadRefused(409, f"a model named {model_name!r} is already loaded (instance {other.pk}, "
                            f"{other.state}); unload it or pick another model_name", code="duplicate_model_name")


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


def _name_taken(names: list[str], *, exclude: int | None = None) -> LoadRefused | None:
    """The refusal for a served name or alias another instance holds as its name or an alias."""
    wanted = set(names)
    holders = ModelInstance.objects.filter(name_holders()).exclude(pk=exclude).values_list("pk", "model_name",
                                                                                           "aliases", "state")
    for pk, name, aliases, state in holders:
        taken = wanted & {name, *(aliases or [])}
        if taken:
            return LoadRefused(409, f"{sorted(taken)[0]!r} is already a name or alias of instance {pk} ({state}); "
                                    "unload it or pick another name", code="duplicate_model_name")
    return None


_placement_locks: dict[int, threading.Lock] = {}
_placement_locks_guard = threading.Lock()


@contextlib.contextmanager
def placement_lock(node_id: int):
    """One placement at a time per node, until the instance that books its GPUs is committed: the
    rooms are read under it, so two simultaneous loads never both take one GPU's free memory.
    PostgreSQL: the node's row locked FOR UPDATE (every web process). SQLite serves one process
    (embedded mode): a lock per node in that process, then the transaction's own write lock."""
    from hardware.models import Node

    if connection.vendor == "sqlite":
        with _placement_locks_guard:
            lock = _placement_locks.setdefault(node_id, threading.Lock())
        with lock, transaction.atomic():
            yield
        return
    with transaction.atomic():
        list(Node.objects.select_for_update().filter(pk=node_id).values_list("pk", flat=True))
        yield


def _no_room(exc: NoRoom) -> LoadRefused:
    refused = LoadRefused(409, exc.message, code="does_not_fit")
    refused.detail = exc.detail()
    return refused


def _evict(victims: list[ModelInstance]) -> None:
    for node_name in {v.node.name for v in victims}:
        nudge_node(node_name)


def request_load(*, model_path: str, model_name: str | None = None, server_type: str = "llm",
                 backend: str | None = None, node: str | None = None, gpus: list[int] | None = None,
                 tensor_parallel_size: int | None = None, extra_args: dict | None = None,
                 autostart: bool = False, user=None, aliases: list[str] | None = None,
                 fallback: bool | None = None, policy: str = Policy.ALWAYS, idle_ttl_s: int | None = None,
                 pinned: bool = False, max_concurrency: int | None = None,
                 start: bool | None = None, first_byte_timeout_s: int | None = None) -> ModelInstance:
    """Plan and record a load, then nudge the node's agent. `always` (and an on_demand load with
    `start`): desired RUNNING, state PENDING, room made by eviction (409 does_not_fit when none
    can be). on_demand without `start`: IDLE, started by the first request.

    `fallback`: may the agent try another backend of the node when this one does not come up?
    None: yes for a backend chosen automatically, no for one asked for by name.

    The plan is made twice: first to pick the node (every node, no lock), then again on that node
    under its placement lock, where the GPU rooms read count every load committed before."""
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
    args = dict(model_path=model_path, model_name=model_name, server_type=server_type, backend=backend, gpus=gpus,
                tensor_parallel_size=tensor_parallel_size, extra_args=extra_args)
    plan = plan_load(node=node, **args)
    aliases = check_aliases(aliases, plan.model_name)
    victims: list[ModelInstance] = []
    on_demand_fields = dict(policy=policy, pinned=pinned, max_concurrency=max_concurrency,
                            first_byte_timeout_s=first_byte_timeout_s,
                            idle_ttl_s=(settings.IDLE_TTL_S if idle_ttl_s is None else idle_ttl_s) if on_demand else 0)
    try:
        with placement_lock(plan.node.pk):
            if plan.gpus:  # GPU memory is booked: read the rooms again, under the lock
                plan = dataclasses.replace(plan_load(node=plan.node.name, **args), placement=plan.placement)
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
    except NoRoom as exc:
        raise _no_room(exc) from None
    except IntegrityError:
        # A load for the same name won the race between the name check and this insert.
        clash = _duplicate(plan.model_name)
        if clash is None:
            raise
        raise clash from None
    inst.announce_created()
    if victims:
        _evict(victims)
    if start_now:
        nudge_node(plan.node.name)
    return inst


def _plan_basis(plan) -> str:
    """Where a new load's figure came from (its plan took the shape's measurement when one was recorded)."""
    measured = plan.estimate.measured
    return (f"{measured} for the same model, backend and context" if measured
            else "the estimate (no measurement of this shape yet)")


def _record_load(plan, *, aliases: list[str], autostart: bool, user, start_now: bool = True,
                 **on_demand_fields) -> ModelInstance:
    clash = _duplicate(plan.model_name)
    if clash is not None:
        raise clash
    clash = _name_taken([plan.model_name, *aliases])
    if clash is not None:
        raise clash
    launch = plan.launch
    return ModelInstance.create_requested(
        message=(f"load requested: {launch.reason}; {launch.fit}" if start_now else
                 f"registered on_demand: {launch.reason}; {launch.fit}; starts on the first request")
        + f"; memory for the fit check: {plan.estimate.total_mib} MiB, {_plan_basis(plan)}",
        state=InstanceState.PENDING if start_now else InstanceState.IDLE,
        model_name=plan.model_name, aliases=aliases, model_path=plan.source.model_path,
        artifact=plan.source.artifact,
        type=launch.server_type, backend=launch.backend, backend_reason=f"{launch.reason} ({plan.placement})",
        node=plan.node, gpus=plan.gpus if start_now else [], tensor_parallel_size=launch.tensor_parallel_size,
        extra_args=plan.extra_args, plan=launch.to_json(), autostart=autostart,
        desired_state=DesiredState.RUNNING if start_now else DesiredState.IDLE,
        state_message="waiting for the node agent" if start_now else "idle: starts on the first request",
        estimated_memory_mib=plan.estimate.total_mib, created_by=user if getattr(user, "pk", None) else None,
        announce=False, **on_demand_fields,
    )


def request_cold_start(*, instance_id: int, reason: str = "started by a request",
                       spare_recent: bool = True) -> ModelInstance:
    """Start an IDLE instance: room made on its node by eviction (NoRoom when none can be), desired
    RUNNING, PENDING, its node nudged. An instance that already left IDLE is returned as it is
    (another request, here or in another web process, started it). `spare_recent`: models used
    within XGEN_EVICT_GRACE_S are not evicted (a request's start; the Start button may)."""
    node_id = ModelInstance.objects.filter(pk=instance_id).values_list("node_id", flat=True).first()
    if node_id is None:
        raise ModelInstance.DoesNotExist(f"no instance {instance_id}")
    try:
        with placement_lock(node_id):
            inst = ModelInstance.objects.select_for_update(of=("self",)).select_related("node").get(pk=instance_id)
            if inst.state != InstanceState.IDLE:
                return inst
            ModelInstance.objects.filter(pk=inst.pk).update(desired_state=DesiredState.RUNNING)
            victims = _checked_start(inst, reason, spare_recent=spare_recent, desired_state=DesiredState.RUNNING,
                                     last_error="", exit_code=None, restarts=0)
    except NoRoom as exc:
        record_refusal(instance_id, exc)
        raise
    if victims:
        _evict(victims)
    nudge_node(inst.node.name)
    return inst


def _checked_start(inst: ModelInstance, reason: str, *, spare_recent: bool = False, **fields) -> list[ModelInstance]:
    """Under the node's placement lock: room made for `inst` with the best memory figure known now
    (capacity.start_memory: its own measurement, its shape's, else the estimate), then PENDING,
    the figure and where it came from in its timeline. Returns the evicted; raises NoRoom."""
    memory = start_memory(inst)
    planned = stored_plan(inst)
    victims = make_room(inst.node, memory.mib, model_name=inst.model_name, exclude=inst.pk,
                        gpus=list(planned.gpus) if planned else None, basis=memory.basis, spare_recent=spare_recent)
    if memory.source == "shape":  # what it is booked at until its own measurement
        fields["estimated_memory_mib"] = memory.mib
    inst.mark_pending(f"{reason}; {memory.note}", **fields)
    return victims


def start_again(instance_id: int, reason: str) -> ModelInstance | None:
    """The node agent starting an instance that stopped with its agent (autostart) or is started
    again on its node: the fit checked as for any start. None when it does not fit: it stays
    STOPPED (desired STOPPED, so nothing waits for it; autostart kept for the next agent) with
    the refusal in its timeline."""
    node_id = ModelInstance.objects.filter(pk=instance_id).values_list("node_id", flat=True).first()
    if node_id is None:
        return None
    try:
        with placement_lock(node_id):
            inst = ModelInstance.objects.select_for_update(of=("self",)).select_related("node").get(pk=instance_id)
            victims = _checked_start(inst, reason)
    except NoRoom as exc:
        ModelInstance.objects.filter(pk=instance_id).update(desired_state=DesiredState.STOPPED,
                                                            state_message=f"start refused: {exc.message}"[:500])
        record_refusal(instance_id, exc)
        return None
    if victims:
        _evict(victims)
    return inst


def request_start(*, instance: ModelInstance) -> ModelInstance:
    """The Start button of an IDLE instance (409 does_not_fit when nothing can make room)."""
    if instance.state != InstanceState.IDLE:
        raise LoadRefused(409, f"instance {instance.pk} is {instance.state}, not IDLE", code="not_idle")
    try:
        return request_cold_start(instance_id=instance.pk, reason="start requested", spare_recent=False)
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
    """Desired STOPPED; the agent stops the process (an instance not running is marked STOPPED now)."""
    ModelInstance.objects.filter(pk=instance.pk).update(desired_state=DesiredState.STOPPED, autostart=False)
    instance.refresh_from_db()
    if instance.state in (InstanceState.ERROR, InstanceState.IDLE) or (
            instance.state == InstanceState.PENDING and not instance.pid):
        try:
            instance.mark_stopped("unloaded")
        except IllegalTransition:  # the agent moved it meanwhile; it stops it now
            instance.refresh_from_db()
    nudge_node(instance.node.name)
    return instance


def request_restart(*, instance: ModelInstance) -> ModelInstance:
    """Stop (if running) and start again; an ERROR or STOPPED instance is started afresh (an
    IDLE one is started, as by a request)."""
    if instance.state == InstanceState.IDLE:
        return request_start(instance=instance)
    if instance.state in (InstanceState.STOPPED, InstanceState.ERROR):
        clash = _duplicate(instance.model_name, exclude=instance.pk)
        if clash is not None:
            raise LoadRefused(409, f"another instance now serves {instance.model_name!r}",
                              code="duplicate_model_name")
        victims: list[ModelInstance] = []
        try:
            with placement_lock(instance.node_id):
                victims = _checked_start(instance, "restart requested", desired_state=DesiredState.RUNNING,
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
            _evict(victims)
    else:
        instance.note_restart_requested()
    nudge_node(instance.node.name)
    return instance


def instances_for_node(node_name: str) -> list[ModelInstance]:
    return list(ModelInstance.objects.select_related("node").filter(node__name=node_name).filter(
        Q(desired_state=DesiredState.RUNNING) | Q(state__in=ACTIVE_STATES) | Q(pid__isnull=False)))


def save_log_tail(instance_id: int, lines: list[str]) -> None:
    ModelInstance.objects.filter(pk=instance_id).update(log_tail=lines[-50:])
