"""Rolling restarts (issue 30 #4): new engine settings (extra_args), or the backend version its
node has now, applied to a model's replicas one at a time, each READY before the next goes.

`request_rollout` checks the new plan of every replica first (a bad flag is a 400 and nothing
changes) and records the rollout on the model's ModelDeployment. The cluster's one decision loop
(the autoscaler's lease holder, serving.control.autoscale) moves it on: while every replica is
READY, the next one gets its new plan and extra_args, leaves routing (UNLOADING, pushed to every
routing table) and is restarted by its node's supervisor once its requests in flight are done
(or at its drain deadline); the loop waits for it to be READY before the next. A model with one
replica is restarted in place (no other replica could serve meanwhile).
"""
from __future__ import annotations

import logging
from datetime import timedelta

from django.utils import timezone

from serving.control.planning import LoadRefused, replan_instance
from serving.control.replicas import DEFAULT_DRAIN_TIMEOUT_S, live_replicas
from serving.control.starts import nudge_node
from serving.models import IllegalTransition, InstanceState, ModelDeployment, ModelInstance

log = logging.getLogger("xgen.serving")


def request_rollout(*, model_name: str, extra_args: dict | None = None,
                    drain_timeout_s: int | None = None, adapters: list[dict] | None = None) -> list[ModelInstance]:
    """Record a rolling restart of the model's replicas with `extra_args` (None: the ones they
    have) and `adapters` (LoRA, None: the ones they have; each replica takes the new set when it
    restarts, so the set a replica serves is the one its engine loaded); every replica's new plan
    is checked now. Returns the replicas in the order they go."""
    live = live_replicas(model_name)
    if not live:
        raise LoadRefused(404, f"no model {model_name[:120]!r} is loaded", code="model_not_found")
    deployment = ModelDeployment.objects.filter(model_name=model_name).first()
    if deployment is None:
        raise LoadRefused(404, f"no model {model_name[:120]!r} is loaded", code="model_not_found")
    if deployment.rollout:
        raise LoadRefused(409, f"a rolling restart of {model_name} is under way "
                               f"({len(deployment.rollout.get('pending', []))} replica(s) to go)",
                          code="rollout_in_progress")
    for inst in live:
        if adapters is not None:
            inst.adapters = adapters  # for the check only: stored when the replica restarts
        replan_instance(inst, inst.extra_args if extra_args is None else extra_args)  # 400 before any change
    timeout = deployment.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
    order = sorted(live, key=lambda i: (i.state == InstanceState.READY, i.replica))  # a broken one first
    deployment.rollout = {"extra_args": extra_args, "adapters": adapters, "pending": [i.pk for i in order], "drain_timeout_s": timeout,
                          "started_at": timezone.now().isoformat(), "total": len(order)}
    deployment.save(update_fields=["rollout"])
    return order


def progress_rollouts() -> list[int]:
    """One step of every rollout under way (the decision loop's leader): the next replica restarted
    when every replica is READY. Returns the instances restarted now."""
    started: list[int] = []
    for deployment in ModelDeployment.objects.filter(rollout__isnull=False):
        rollout = dict(deployment.rollout or {})
        live = live_replicas(deployment.model_name)
        ids = {i.pk for i in live}
        pending = [pk for pk in rollout.get("pending", []) if pk in ids]
        if any(i.state != InstanceState.READY or i.restart_requested for i in live if i.pk not in pending[:1]):
            continue  # the one before is not READY again yet
        if not pending:
            deployment.rollout = None
            deployment.save(update_fields=["rollout"])
            continue
        inst = next(i for i in live if i.pk == pending[0])
        rollout["pending"] = pending[1:]
        deployment.rollout = rollout
        deployment.save(update_fields=["rollout"])
        step = f"{rollout.get('total', len(live)) - len(pending) + 1} of {rollout.get('total', len(live))}"
        try:
            extra = inst.extra_args if rollout.get("extra_args") is None else rollout["extra_args"]
            if rollout.get("adapters") is not None:
                inst.adapters = rollout["adapters"]
            plan, normalized = replan_instance(inst, extra)
        except LoadRefused as exc:
            inst.note(f"rolling restart ({step}) skipped: {exc.message}")
            continue
        others_serve = len(live) > 1 and inst.state == InstanceState.READY
        until = timezone.now() + timedelta(seconds=int(rollout.get("drain_timeout_s", DEFAULT_DRAIN_TIMEOUT_S)))
        ModelInstance.objects.filter(pk=inst.pk).update(
            plan=plan.to_json(), extra_args=normalized, restart_requested=True, adapters=inst.adapters,
            drain_until=until if others_serve else None, updated_at=timezone.now())
        inst.refresh_from_db()
        inst.note(f"rolling restart ({step}): {plan.backend} {plan.version}, extra_args {normalized}")
        if others_serve:
            try:
                inst.mark_unloading(f"rolling restart ({step}): out of routing, finishing its requests in flight")
            except IllegalTransition:
                pass
        nudge_node(inst.node.name)
        started.append(inst.pk)
    return started
