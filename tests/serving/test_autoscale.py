"""The autoscaler (issue 30 #2): the decision on a model's load (sustained load adds a replica
after the scale-up window, no load removes it after the scale-down delay, a load oscillating
around the threshold makes at most one change per window), the lease that makes one loop decide
for the cluster, and a tick on the database: the fleet's reports summed, request_scale called,
the decision a row, in the audit log and on the model's page."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from tests.conftest import bearer

POLICY_KW = dict(min_replicas=1, max_replicas=2, target_in_flight=1.0, up_window_s=30, down_delay_s=600)


def _run(loads, *, start_replicas: int = 1, policy=None, step_s: float = 1.0):
    """Feed `loads` (one a step) to decide(); the changes made: (time, from, to, why)."""
    from serving.control.autoscale import History, Policy, decide

    policy = policy or Policy(**POLICY_KW)
    history, current, last, changes = History(), start_replicas, None, []
    for n, load in enumerate(loads):
        now = n * step_s
        history.add(now, load, keep_s=max(policy.up_window_s, policy.down_delay_s) + 5)
        verdict = decide(history, current=current, policy=policy, now=now, last_change=last)
        if verdict is not None:
            changes.append((now, current, verdict[0], verdict[1]))
            current, last = verdict[0], now
    return changes


def test_sustained_load_adds_a_replica_after_the_window_and_no_load_removes_it_after_the_delay():
    loads = [0] * 10 + [3] * 60 + [0] * 700
    changes = _run(loads)
    assert [(t, a, b) for t, a, b, _ in changes] == [(40, 1, 2), (70 + 600, 2, 1)]
    assert "above 1 x 1 per replica (scale-up window 30 s)" in changes[0][3]
    assert "scale-down delay 600 s" in changes[1][3]
    # Load above the target for less than the window: no change.
    assert _run([0] * 10 + [3] * 29 + [0] * 100) == []


def test_a_load_oscillating_around_the_threshold_makes_at_most_one_change_per_window():
    from serving.control.autoscale import Policy

    policy = Policy(min_replicas=1, max_replicas=4, target_in_flight=1.0, up_window_s=30, down_delay_s=60)
    # 1 and 2 requests in flight alternating every 5 s, for 20 minutes: around the 1-replica threshold.
    loads = [1 if (n // 5) % 2 else 2 for n in range(1200)]
    changes = _run(loads, policy=policy)
    assert changes == [], "a dip below the threshold within each window: never a change"
    # Swinging between 0 and 3 every 40 s (longer than the up window, shorter than the down delay).
    swings = [3 if (n // 40) % 2 else 0 for n in range(1200)]
    changes = _run(swings, policy=policy)
    times = [t for t, *_ in changes]
    assert len(changes) <= 1200 // 30, changes
    assert all(b - a >= 30 for a, b in zip(times, times[1:], strict=False)), times
    assert all(to != 1 for _, _, to, _ in changes[1:]), "never down: the load came back within every delay"
    print(f"\noscillating 0/3 every 40 s for 20 min: {len(changes)} change(s): {[(t, a, b) for t, a, b, _ in changes]}")


def test_the_bounds_hold_whatever_the_load():
    from serving.control.autoscale import Policy

    policy = Policy(min_replicas=2, max_replicas=3, target_in_flight=2.0, up_window_s=5, down_delay_s=5)
    assert [policy.recommend(x) for x in (0, 1, 4, 5, 100)] == [2, 2, 2, 3, 3]
    assert _run([50] * 20, start_replicas=1, policy=policy)[0][1:3] == (1, 2), "below min: up at once"
    changes = _run([50] * 20, start_replicas=2, policy=policy)
    assert [(a, b) for _, a, b, _ in changes] == [(2, 3)], "never past max"


@pytest.mark.django_db
def test_one_holder_of_the_lease_at_a_time_and_an_expired_one_is_taken_over():
    from serving.control.autoscale import hold_lease
    from serving.models import ControllerLease

    assert hold_lease("web-a") is True
    assert hold_lease("web-b") is False
    assert hold_lease("web-a") is True  # renewed
    ControllerLease.objects.filter(name="autoscaler").update(expires_at=timezone.now() - timedelta(seconds=1))
    assert hold_lease("web-b") is True and hold_lease("web-a") is False
    assert ControllerLease.objects.get(name="autoscaler").holder == "web-b"


@pytest.mark.django_db
def test_a_tick_scales_on_the_fleets_reports_and_records_the_decision(client, node, operator, tiny_gguf):
    from accounts.models import AuditEvent
    from serving.control.autoscale import tick
    from serving.models import InFlightReport, ModelDeployment, ModelInstance, ScalingDecision

    r = client.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "auto"},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code == 202, r.content
    r = client.post("/api/management/autoscale", {"model_name": "auto", "min_replicas": 1, "max_replicas": 2,
                                                  "target_in_flight": 1, "scale_up_window_s": 5,
                                                  "scale_down_delay_s": 10},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code == 200, r.content
    assert r.json()["enabled"] is True and r.json()["decisions"] == []
    ModelDeployment.objects.filter(model_name="auto").update(last_scaled_at=None)
    histories: dict = {}
    t0 = timezone.now().timestamp()
    for n in range(8):  # two web processes report 1 request in flight each: 2 > 1 x 1
        for process in ("web-a:1", "web-b:2"):
            InFlightReport.objects.update_or_create(process=process, model_name="auto",
                                                    defaults={"in_flight": 1, "queued": 0, "at": timezone.now()})
        tick(histories, now=t0 + n)
    decision = ScalingDecision.objects.get(model_name="auto")
    assert (decision.from_replicas, decision.to_replicas) == (1, 2), decision.reason
    assert "load 2-2 in flight+queued for 5 s" in decision.reason
    assert ModelInstance.objects.filter(model_name="auto", desired_state="RUNNING").count() == 2
    audit = AuditEvent.objects.get(action="autoscale")
    assert audit.target == "auto" and audit.detail["to"] == 2
    # Stale reports count as 0; the model's page shows the decision.
    InFlightReport.objects.update(at=timezone.now() - timedelta(minutes=1))
    from serving.control.autoscale import fleet_load

    assert fleet_load("auto") == 0
    from django.test import Client

    page = Client()
    page.force_login(operator.user)
    pk = ModelInstance.objects.filter(model_name="auto").order_by("pk").first().pk
    html = page.get(f"/instances/{pk}/").content.decode()
    assert 'id="autoscaling"' in html and "1..2 replicas at 1.0 requests in flight" in html
    assert "scale-up window 5 s" in html
    # Off again: null target; the refusals are OpenAI-style.
    r = client.post("/api/management/autoscale", {"model_name": "auto", "max_replicas": 2, "target_in_flight": None},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code == 200 and r.json()["enabled"] is False and len(r.json()["decisions"]) == 1
    r = client.post("/api/management/autoscale", {"model_name": "auto", "min_replicas": 3, "max_replicas": 2,
                                                  "target_in_flight": 1},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = client.post("/api/management/autoscale", {"model_name": "never", "max_replicas": 2, "target_in_flight": 1},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
