"""Migration 0005 (launch plan) on a database 0.1.0 filled: instances that raced to one served name become
numbered replicas (so the unique index can be built), and their rows have no plan yet."""
from __future__ import annotations

import pytest
from django.utils import timezone

from tests.migrations import latest as _latest
from tests.migrations import migrate_to as _migrate

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("serving", "0003_restart_requested")]


def test_duplicates_from_0_1_0_become_replicas():
    apps = _migrate(BEFORE)
    try:
        Node = apps.get_model("hardware", "Node")
        Instance = apps.get_model("serving", "ModelInstance")
        node = Node.objects.create(name="old-node", address="127.0.0.1", last_heartbeat=timezone.now())
        ids = [Instance.objects.create(model_name=name, model_path="/m.gguf", backend="llama-cpp-python", node=node,
                                       state=state, desired_state=desired).pk
               for name, state, desired in [("twin", "READY", "RUNNING"), ("twin", "LOADING", "RUNNING"),
                                            ("twin", "STOPPED", "RUNNING"), ("twin", "STOPPED", "STOPPED"),
                                            ("solo", "READY", "RUNNING")]]
    finally:
        apps = _migrate(_latest())
    Instance = apps.get_model("serving", "ModelInstance")
    replicas = [Instance.objects.get(pk=pk).replica for pk in ids]
    assert replicas == [0, 1, 2, 0, 0]
    assert all(Instance.objects.get(pk=pk).plan is None for pk in ids)

