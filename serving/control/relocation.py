"""Moving a model off a node that left (issue 31 #4): offline, or draining.

A node is *away* when its agent has beaten no heartbeat for XGEN_NODE_OFFLINE_AFTER (a killed agent,
a lost host: the autoscaler's lease holder finds it, every tick), or when its agent got SIGTERM (a
deleted pod of a drained or unlabelled Kubernetes node, `systemctl stop`: the agent itself calls
`relocate` for its own node before it drains). Both go through `relocate`, the path a scale-up takes:
each replica the node held that is still wanted (desired RUNNING or IDLE) is counted against the
served name's desired count (its ModelDeployment row; no row: 1), and the replicas missing from the
other nodes are planned and placed by place_replicas (every online node but the away one: fits,
cache, backend, eviction), under the placement locks. Each one placed retires one replica of the away
node in the same transaction: desired STOPPED, autostart off, so an agent that comes back stops it
instead of serving a duplicate beyond the desired count; out of routing (UNLOADING) unless it served
nothing. A replica nothing can take stays where it is (it serves again when its node is back), and
is noted in the log once. Each move is a ScalingDecision row (the reason names the node and why)
and a `relocate` audit row.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from hardware.models import Node
from serving.control.planning import LoadRefused
from serving.control.replicas import place_replicas, placement_locks
from serving.control.starts import evict, nudge_node
from serving.models import (
    DesiredState,
    IllegalTransition,
    InstanceState,
    ModelDeployment,
    ModelInstance,
    ScalingDecision,
    name_holders,
)

log = logging.getLogger("xgen.serving")

_noted: set[int] = set()  # away replicas whose refusal was logged by this process (once each)


@dataclass
class Moved:
    """One replica moved: the one retired on the away node and the one placed for it."""

    model_name: str
    old: ModelInstance
    new: ModelInstance


def wanted_on(node: Node) -> Q:
    """The node's replicas still meant to serve: they hold their name and are not being stopped."""
    return name_holders() & Q(node=node) & Q(desired_state__in=(DesiredState.RUNNING, DesiredState.IDLE))


def offline_nodes(*, now=None) -> list[Node]:
    """Nodes with a replica still wanted whose agent has beaten no heartbeat for NODE_OFFLINE_AFTER_S."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.NODE_OFFLINE_AFTER_S)
    held = ModelInstance.objects.filter(name_holders(), desired_state__in=(DesiredState.RUNNING, DesiredState.IDLE))
    return list(Node.objects.filter(Q(last_heartbeat__lt=cutoff) | Q(last_heartbeat__isnull=True),
                                    pk__in=held.values("node_id")).order_by("name"))


def desired_count(model_name: str) -> int:
    """The served name's desired replicas (a model loaded before deployments existed: 1)."""
    replicas = ModelDeployment.objects.filter(model_name=model_name).values_list("replicas", flat=True).first()
    return 1 if replicas is None else replicas


def relocate(node: Node, *, why: str, out_of_routing: bool = True) -> list[Moved]:
    """Place the replicas `node` holds that the desired counts still want on the other online nodes,
    and retire one of the node's for each one placed. `why`: what happened to the node, for the
    records ("offline (no heartbeat for 61 s)", "draining (its agent got SIGTERM)").
    `out_of_routing`: mark the retired ones UNLOADING now (False: the node's own draining agent
    does, once it has read which are READY, so their requests in flight finish first)."""
    from accounts.audit import record_audit

    names = sorted(set(ModelInstance.objects.filter(wanted_on(node)).values_list("model_name", flat=True)))
    moved: list[Moved] = []
    for name in names:
        try:
            moved += _relocate_model(node, name, why=why, out_of_routing=out_of_routing)
        except LoadRefused as exc:  # the stored load no longer plans anywhere (its file went away)
            _note_once(node, name, exc.message)
        except Exception:  # one model's failure never keeps the others where they are
            log.warning("relocating %s off %s failed", name, node.name, exc_info=True)
    for m in moved:
        record_audit(action="relocate", target=m.model_name, actor="controller",
                     detail={"from_node": node.name, "to_node": m.new.node.name, "old_instance": m.old.pk,
                             "new_instance": m.new.pk, "why": why[:300]})
    return moved


def _relocate_model(node: Node, name: str, *, why: str, out_of_routing: bool) -> list[Moved]:
    targets = set(Node.placeable().exclude(pk=node.pk).values_list("pk", flat=True))
    if not targets:
        _note_once(node, name, "no other node agent is online")
        return []
    with placement_locks(targets | {node.pk}):
        away = list(ModelInstance.objects.select_for_update().select_related("node")
                    .filter(wanted_on(node), model_name=name).order_by("-replica"))
        serving = ModelInstance.objects.filter(name_holders(), model_name=name, node_id__in=targets).exclude(
            desired_state=DesiredState.STOPPED).count()
        missing = min(len(away), desired_count(name) - serving)
        if not away or missing <= 0:
            return []
        created, victims, refusals = [], [], []
        for old in away[:missing]:  # one at a time: each keeps its own policy (IDLE stays IDLE)
            placed = place_replicas(first=old, count=1, start_now=old.desired_state == DesiredState.RUNNING,
                                    exclude_nodes={node.pk})
            if not placed.created:
                refusals += placed.refusals
                continue
            new = placed.created[0]
            victims += placed.victims
            created.append((old, new))
            ModelInstance.objects.filter(pk=old.pk).update(
                desired_state=DesiredState.STOPPED, autostart=False, drain_until=None, updated_at=timezone.now(),
                state_message=f"moved to {new.node.name} (replica {new.replica}): node {node.name} {why}"[:500])
        moved = [Moved(model_name=name, old=old, new=new) for old, new in created]
        if moved:
            reason = (f"node {node.name} {why}: " + "; ".join(
                f"replica {m.old.replica} moved to {m.new.node.name} as replica {m.new.replica}" for m in moved))
            if refusals:
                reason += f"; not placed: {'; '.join(refusals)[:300]}"
            ScalingDecision.objects.create(model_name=name, from_replicas=serving,
                                           to_replicas=serving + len(moved), reason=reason[:2000])
    if refusals and not moved:
        _note_once(node, name, "; ".join(refusals))
    for m in moved:
        m.new.announce_created()
        if out_of_routing:
            _retire(m.old, reason=f"moved to {m.new.node.name} (replica {m.new.replica}): node {node.name} {why}")
    if victims:
        evict(victims)
    for node_name in {m.new.node.name for m in moved}:
        nudge_node(node_name)
    return moved


def _retire(old: ModelInstance, *, reason: str) -> None:
    """Out of routing: a backend that may still run (its agent dead, or draining) goes UNLOADING
    (its agent, back or still here, stops it: desired STOPPED); one that served nothing, STOPPED."""
    old.refresh_from_db()
    try:
        if old.state == InstanceState.IDLE:
            old.mark_stopped(reason)
        elif old.state not in (InstanceState.STOPPED, InstanceState.UNLOADING):
            old.mark_unloading(reason)
    except IllegalTransition:  # its agent moved it meanwhile; desired STOPPED stops it
        pass
    nudge_node(old.node.name)


def _note_once(node: Node, name: str, why: str) -> None:
    ids = set(ModelInstance.objects.filter(wanted_on(node), model_name=name).values_list("pk", flat=True))
    if ids - _noted:
        log.info("cannot move %s off node %s: %s", name, node.name, why[:400])
        _noted.update(ids)


def relocate_offline() -> list[Moved]:
    """One pass of the controller: every offline node's wanted replicas moved where they fit."""
    moved: list[Moved] = []
    now = timezone.now()
    for node in offline_nodes(now=now):
        age = f"{(now - node.last_heartbeat).total_seconds():.0f} s" if node.last_heartbeat else "ever"
        moved += relocate(node, why=f"offline (no heartbeat for {age})")
    return moved
