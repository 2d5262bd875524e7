"""Autoscaling (issue 30 #2): a model's replica count follows its load between a minimum and a
maximum.

The load is the requests in flight plus those queued, summed over every web process (each writes
its InFlightReport every ACTIVITY_FLUSH_S; rows older than three flushes count as 0). The
recommendation is ceil(load / target_in_flight) clamped to [min_replicas, max_replicas] (KubeAI's
`targetRequests` per replica). It never flaps: a replica is added only when every sample of the
last scale_up_window_s recommends more (the smallest of them is taken), and removed only when every
sample of the last scale_down_delay_s recommends fewer (the largest is taken), and never within
that window of the last change (so an oscillating load makes at most one change per window).
Defaults from the peers: 30 s up (Fireworks' scale-up window), 10 min down (Fireworks' scale-down
window; KubeAI's scaleDownDelaySeconds is the same idea). A change goes through request_scale with
`partial` (never past what fits), and is a ScalingDecision row and an audit row.

One decision loop for the cluster: every web process runs `run_loop`, and only the holder of the
`autoscaler` ControllerLease row decides (a conditional UPDATE takes an expired lease; the holder
renews it each tick). In the embedded mode that is the one process. A new holder observes a full
window before it changes anything (its samples are its own). The same holder moves the replicas of
offline nodes to the other nodes (serving.control.relocation, issue 31 #4).
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import Q, Sum
from django.utils import timezone

from serving.control.capacity import report_fresh_s
from serving.control.planning import LoadRefused
from serving.control.relocation import relocate_offline
from serving.control.replicas import live_replicas, request_scale
from serving.control.rollout import progress_rollouts
from serving.models import ControllerLease, InFlightReport, ModelDeployment, ScalingDecision

log = logging.getLogger("xgen.autoscale")

DEFAULT_UP_WINDOW_S = 30
DEFAULT_DOWN_DELAY_S = 600
TICK_S = 1.0
LEASE_NAME = "autoscaler"
LEASE_TTL_S = 10.0


@dataclass(frozen=True)
class Policy:
    """A model's autoscaling settings."""

    min_replicas: int
    max_replicas: int
    target_in_flight: float
    up_window_s: float = DEFAULT_UP_WINDOW_S
    down_delay_s: float = DEFAULT_DOWN_DELAY_S

    def recommend(self, load: float) -> int:
        """Replicas for `load` requests in flight and queued, within the bounds."""
        want = math.ceil(load / self.target_in_flight) if load > 0 else 0
        return max(self.min_replicas, min(self.max_replicas, want))


@dataclass
class History:
    """The load samples one decision loop has seen for a model: (time, load)."""

    samples: deque = field(default_factory=deque)
    since: float | None = None  # when this loop began observing

    def add(self, at: float, load: float, keep_s: float) -> None:
        if self.since is None:
            self.since = at
        self.samples.append((at, load))
        while self.samples and self.samples[0][0] < at - keep_s:
            self.samples.popleft()


def decide(history: History, *, current: int, policy: Policy, now: float,
           last_change: float | None) -> tuple[int, str] | None:
    """(replicas, why) when the count should change now, else None."""
    if current < policy.min_replicas:
        return policy.min_replicas, f"below min_replicas {policy.min_replicas}"
    if current > policy.max_replicas:
        return policy.max_replicas, f"above max_replicas {policy.max_replicas}"
    if history.since is None:
        return None
    since_change = math.inf if last_change is None else now - last_change
    for window, up in ((policy.up_window_s, True), (policy.down_delay_s, False)):
        if now - history.since < window or since_change < window:
            continue  # not observed for a whole window yet, or changed within it
        seen = [load for at, load in history.samples if at >= now - window]
        if not seen:
            continue
        recs = [policy.recommend(load) for load in seen]
        want = min(recs) if up else max(recs)
        if (up and want > current) or (not up and want < current):
            low, high = min(seen), max(seen)
            per = f"{policy.target_in_flight:g} per replica"
            what = f"load {low:g}-{high:g} in flight+queued for {window:g} s"
            return want, (f"{what}: above {current} x {per} (scale-up window {window:g} s)" if up else
                          f"{what}: {want} replica(s) at {per} suffice (scale-down delay {window:g} s)")
    return None


def hold_lease(holder: str, *, name: str = LEASE_NAME, ttl_s: float = LEASE_TTL_S) -> bool:
    """Take or renew the lease; False while another holder's has not expired."""
    now = timezone.now()
    until = now + timedelta(seconds=ttl_s)
    if ControllerLease.objects.filter(name=name).filter(Q(holder=holder) | Q(expires_at__lt=now)).update(
            holder=holder, expires_at=until):
        return True
    if ControllerLease.objects.filter(name=name).exists():
        return False  # another holder's, not expired: no insert to fail (PostgreSQL logs each duplicate key)
    try:
        with transaction.atomic():
            ControllerLease.objects.create(name=name, holder=holder, expires_at=until)
    except IntegrityError:
        return False
    return True


def fleet_load(model_name: str) -> float:
    """Requests in flight plus queued for the model, summed over the web processes' fresh reports."""
    fresh = timezone.now() - timedelta(seconds=report_fresh_s())
    sums = InFlightReport.objects.filter(model_name=model_name, at__gte=fresh).aggregate(
        flying=Sum("in_flight"), queued=Sum("queued"))
    return float((sums["flying"] or 0) + (sums["queued"] or 0))


def policy_of(deployment: ModelDeployment) -> Policy:
    return Policy(min_replicas=deployment.min_replicas, max_replicas=max(1, deployment.max_replicas),
                  target_in_flight=float(deployment.target_in_flight or 1),
                  up_window_s=deployment.scale_up_window_s, down_delay_s=deployment.scale_down_delay_s)


def tick(histories: dict[str, History], *, now: float | None = None) -> list[ScalingDecision]:
    """One pass of the loop (the lease held): sample each autoscaled model's load, decide, scale."""
    from accounts.audit import record_audit

    now = timezone.now().timestamp() if now is None else now
    made: list[ScalingDecision] = []
    for deployment in ModelDeployment.objects.filter(target_in_flight__gt=0, replicas__gt=0):
        name = deployment.model_name
        policy = policy_of(deployment)
        live = live_replicas(name)
        if not live:
            continue
        history = histories.setdefault(name, History())
        load = fleet_load(name)
        history.add(now, load, keep_s=max(policy.up_window_s, policy.down_delay_s) + 5)
        last = deployment.last_scaled_at.timestamp() if deployment.last_scaled_at else None
        # min 0: the last replica is left to on_demand's idle unload (a request starts one again).
        verdict = decide(history, current=len(live), policy=policy, now=now, last_change=last)
        if verdict is None:
            continue
        want, why = verdict
        want = max(1, want)
        if want == len(live):
            continue
        try:
            done = request_scale(model_name=name, replicas=want, partial=True)
        except LoadRefused as exc:
            log.info("autoscaler: %s to %s refused: %s", name, want, exc.message)
            continue
        if done.replicas == len(live):
            # Nothing fits: no change; noted at most once per window (the next try waits a window).
            ModelDeployment.objects.filter(pk=deployment.pk).update(last_scaled_at=timezone.now())
            why = f"{why}; wanted {want} but none more fits: {'; '.join(done.refusals)[:300]}"
        elif done.partial:
            why = f"{why}; wanted {want}, {done.replicas} fit: {'; '.join(done.refusals)[:300]}"
        decision = ScalingDecision.objects.create(model_name=name, from_replicas=len(live),
                                                  to_replicas=done.replicas, reason=why)
        made.append(decision)
        record_audit(action="autoscale", target=name, actor="autoscaler",
                     detail={"from": len(live), "to": done.replicas, "why": why[:300]})
    return made


HOLDER = f"{socket.gethostname()}:{os.getpid()}"


def may_relocate(reads_ok_since: float | None, now: float) -> bool:
    """Offline nodes are believed once this loop has read the database without a failure for
    NODE_OFFLINE_AFTER_S: after an outage (no agent could beat a heartbeat) or a new lease every node
    gets that long to beat one again before its replicas are moved."""
    return reads_ok_since is not None and now - reads_ok_since >= settings.NODE_OFFLINE_AFTER_S


async def run_loop(stop: asyncio.Event | None = None) -> None:
    """The decision loop of this web process: each TICK_S, if it holds the lease, one tick."""
    from live.db import run_db

    histories: dict[str, History] = {}
    leading = False
    ok_since: float | None = None  # since when every read of this leader succeeded
    while stop is None or not stop.is_set():
        try:
            held = await run_db(hold_lease, HOLDER)
            if held != leading:
                log.info("autoscaler: %s the lease (%s)", "took" if held else "lost", HOLDER)
                histories.clear()  # a new leader observes a whole window before it acts
                leading = held
                ok_since = None
            if held:
                ok_since = time.monotonic() if ok_since is None else ok_since
                await run_db(tick, histories)
                await run_db(progress_rollouts)  # rolling restarts (issue 30 #4), moved on by the same leader
                if may_relocate(ok_since, time.monotonic()):
                    await run_db(relocate_offline)  # offline nodes' models (issue 31 #4)
        except asyncio.CancelledError:
            raise
        except DatabaseError as exc:  # the database is away: one line, as the pages and the proxy log it
            ok_since = None
            log.warning("autoscaler tick failed: the database is unavailable (%s)", str(exc).splitlines()[0] if str(exc) else
                        exc.__class__.__name__)
        except Exception:
            ok_since = None
            log.warning("autoscaler tick failed", exc_info=True)
        await asyncio.sleep(TICK_S)
