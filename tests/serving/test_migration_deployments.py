"""Migration 0017 (issue 30): every served name an instance has gets its one ModelDeployment row,
its desired replica count the instances that hold the name (0 for a name only stopped ones have)."""
from __future__ import annotations

import pytest
from django.utils import timezone

from tests.migrations import latest as _latest
from tests.migrations import migrate_to as _migrate

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("serving", "0016_usage_journal_segment")]


def test_one_deployment_per_served_name_with_its_holders_counted():
    apps = _migrate(BEFORE)
    try:
        Node = apps.get_model("hardware", "Node")
        Instance = apps.get_model("serving", "ModelInstance")
        node = Node.objects.create(name="old-node", address="127.0.0.1", last_heartbeat=timezone.now())
        for name, replica, state, desired in [("twin", 0, "READY", "RUNNING"), ("twin", 1, "LOADING", "RUNNING"),
                                              ("twin", 2, "STOPPED", "STOPPED"), ("solo", 0, "IDLE", "IDLE"),
                                              ("gone", 0, "STOPPED", "STOPPED"), ("back", 0, "STOPPED", "RUNNING")]:
            Instance.objects.create(model_name=name, replica=replica, model_path="/m.gguf", backend="llama-server",
                                    node=node, state=state, desired_state=desired)
    finally:
        apps = _migrate(_latest())
    Deployment = apps.get_model("serving", "ModelDeployment")
    assert dict(Deployment.objects.values_list("model_name", "replicas")) == {
        "twin": 2, "solo": 1, "gone": 0, "back": 1}
    assert set(Deployment.objects.values_list("drain_timeout_s", flat=True)) == {30}
