"""Starting an instance, as the desired-state writes it is: under the node's placement lock, room
made by eviction (make_room turns the evicted instances' desired state to IDLE), the instance's own
desired RUNNING and PENDING (ModelInstance.mark_pending), then a nudge to the node's agent (a
message; the agent would also notice on its next reconcile). The proxy's cold start (start_idle),
the Start button and the agent's own restarts (start_again) all come here; the commands the web
side issues (serving.control.services) build on it."""
from __future__ import annotations

import contextlib
import threading

from django.db import connection, transaction

from live.groups import send_sync
from serving.control import events
from serving.control.capacity import NoRoom, make_room, record_refusal, start_memory
from serving.control.planning import stored_plan
from serving.models import DesiredState, InstanceState, ModelInstance


def nudge_node(node_name: str) -> None:
    """Wake the node's agent now (it would also notice within RECONCILE_INTERVAL_S)."""
    send_sync(events.node_group(node_name), {"type": "agent.nudge"})  # bounded; the agent also reconciles


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


def evict(victims: list[ModelInstance]) -> None:
    """Nudge the nodes of instances whose desired state make_room turned to IDLE."""
    for node_name in {v.node.name for v in victims}:
        nudge_node(node_name)


def start_idle(*, instance_id: int, reason: str = "started by a request",
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
            victims = checked_start(inst, reason, spare_recent=spare_recent, desired_state=DesiredState.RUNNING,
                                     last_error="", exit_code=None, restarts=0)
    except NoRoom as exc:
        record_refusal(instance_id, exc)
        raise
    if victims:
        evict(victims)
    nudge_node(inst.node.name)
    return inst


def checked_start(inst: ModelInstance, reason: str, *, spare_recent: bool = False, **fields) -> list[ModelInstance]:
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
            victims = checked_start(inst, reason)
    except NoRoom as exc:
        ModelInstance.objects.filter(pk=instance_id).update(desired_state=DesiredState.STOPPED,
                                                            state_message=f"start refused: {exc.message}"[:500])
        record_refusal(instance_id, exc)
        return None
    if victims:
        evict(victims)
    return inst


