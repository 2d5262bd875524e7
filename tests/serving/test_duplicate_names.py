"""One served name, one holder: a database constraint decides, so two loads racing for a name can
never both be accepted (issue 17 #4; the race itself on PostgreSQL is tests/cluster/test_duplicate_names.py)."""
from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from serving.models import DesiredState, InstanceState, ModelInstance
from tests.conftest import bearer

pytestmark = pytest.mark.django_db


def _row(node, name, **fields):
    return ModelInstance.objects.create(model_name=name, model_path="/m/x.gguf", backend="llama-cpp-python",
                                        node=node, **fields)


@pytest.mark.parametrize("state,desired", [
    (InstanceState.PENDING, DesiredState.RUNNING), (InstanceState.CACHING, DesiredState.RUNNING),
    (InstanceState.READY, DesiredState.RUNNING), (InstanceState.UNLOADING, DesiredState.STOPPED),
    (InstanceState.STOPPED, DesiredState.RUNNING),  # the agent starts it again: it keeps its name
])
def test_the_database_refuses_a_second_holder_of_a_name(node, state, desired):
    _row(node, "dup", state=InstanceState.READY)
    with pytest.raises(IntegrityError), transaction.atomic():
        _row(node, "dup", state=state, desired_state=desired)


def test_names_that_are_not_held_do_not_count(node):
    _row(node, "free", state=InstanceState.STOPPED, desired_state=DesiredState.STOPPED)
    _row(node, "free", state=InstanceState.ERROR)
    _row(node, "free", state=InstanceState.READY)
    _row(node, "free", state=InstanceState.READY, replica=1)  # replicas are numbered on purpose
    assert ModelInstance.objects.filter(model_name="free").count() == 4


def test_a_load_that_loses_the_race_is_409_duplicate_model_name(client, node, operator, tiny_gguf, monkeypatch):
    from serving.control import services

    body = {"model_path": str(tiny_gguf), "model_name": "racer"}
    r = client.post("/api/management/load", body, content_type="application/json", **bearer(operator.key))
    assert r.status_code == 202
    check = services._duplicate
    calls = []

    def lost_race(name, **kw):  # the check ran before the other load's insert committed
        calls.append(name)
        return None if len(calls) == 1 else check(name, **kw)

    monkeypatch.setattr(services, "_duplicate", lost_race)
    r = client.post("/api/management/load", body, content_type="application/json", **bearer(operator.key))
    assert r.status_code == 409, r.content
    assert r.json()["error"]["code"] == "duplicate_model_name" and "racer" in r.json()["error"]["message"]
    assert ModelInstance.objects.filter(model_name="racer").count() == 1
