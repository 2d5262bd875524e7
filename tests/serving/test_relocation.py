"""Moving a model off a node that left (issue 31 #4), the decision on the database: an offline node's
replicas are placed on the other online nodes through the load's placement, as many as the desired
count misses, each one placed retiring the old (desired STOPPED, out of routing) so a node that comes
back adds no duplicate; a ScalingDecision and an audit row say why. Nothing fits elsewhere: nothing
changes. The agents' side (kill -9 and SIGTERM of a real agent) runs in
tests/cluster/test_node_relocation.py."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from tests.conftest import bearer
from tests.serving.conftest import LLAMA_CPP_PYTHON, NODE

pytestmark = pytest.mark.django_db
OTHER = "node-u"


def _load(client, key, **body) -> list[int]:
    r = client.post("/api/management/load", body, content_type="application/json", **bearer(key))
    assert r.status_code == 202, r.content
    return [x["id"] for x in r.json()["replicas"]]


def _ready(pk: int) -> None:
    from serving.models import ModelInstance

    inst = ModelInstance.objects.get(pk=pk)
    inst.mark_loading(pid=0, pgid=0, port=40000 + pk, gpus=[], message="start")
    inst.mark_warming()
    inst.mark_ready("ready")


def _other_node():
    from hardware.services import register_node

    node = register_node(name=OTHER, address="127.0.0.1")
    node.backends = [LLAMA_CPP_PYTHON]
    node.save()
    return node


def _offline(name: str) -> None:
    from django.conf import settings

    from hardware.models import Node

    Node.objects.filter(name=name).update(
        last_heartbeat=timezone.now() - timedelta(seconds=settings.NODE_OFFLINE_AFTER_S + 1))


def _rows(model: str) -> list[tuple]:
    from serving.models import ModelInstance

    return sorted((i.node.name, i.replica, i.state, i.desired_state)
                  for i in ModelInstance.objects.filter(model_name=model).select_related("node"))


def test_an_offline_nodes_model_is_placed_on_another_node_once_and_the_old_one_retired(
        client, node, operator, tiny_gguf):
    from accounts.models import AuditEvent
    from serving.control.relocation import relocate_offline
    from serving.models import ModelInstance, ScalingDecision

    _other_node()
    [old] = _load(client, operator.key, model_path=str(tiny_gguf), model_name="tiny", node=NODE, autostart=True)
    _ready(old)
    assert relocate_offline() == [], "both nodes online: nothing moves"
    _offline(NODE)
    [moved] = relocate_offline()
    assert (moved.old.pk, moved.new.node.name) == (old, OTHER)
    assert _rows("tiny") == [(NODE, 0, "UNLOADING", "STOPPED"), (OTHER, 1, "PENDING", "RUNNING")]
    retired = ModelInstance.objects.get(pk=old)
    assert retired.autostart is False, "an agent that comes back must not start it again"
    assert "moved to node-u (replica 1): node node-t offline (no heartbeat for" in retired.state_message
    new = ModelInstance.objects.get(pk=moved.new.pk)
    assert new.autostart is True and new.plan["argv"], "the load's own settings, planned as a load is"
    decision = ScalingDecision.objects.get(model_name="tiny")
    assert (decision.from_replicas, decision.to_replicas) == (0, 1)
    assert decision.reason.startswith("node node-t offline (no heartbeat for ")
    assert "replica 0 moved to node-u as replica 1" in decision.reason
    audit = AuditEvent.objects.get(action="relocate")
    assert (audit.actor, audit.target, audit.detail["to_node"]) == ("controller", "tiny", OTHER)
    # No flap: the next passes, and the node coming back, add nothing.
    assert relocate_offline() == []
    from hardware.models import Node

    Node.objects.filter(name=NODE).update(last_heartbeat=timezone.now())
    assert relocate_offline() == []
    assert ScalingDecision.objects.count() == 1
    assert ModelInstance.objects.filter(model_name="tiny", desired_state="RUNNING").count() == 1


def test_only_the_replicas_the_desired_count_misses_are_placed(client, node, operator, tiny_gguf):
    from serving.control.relocation import relocate_offline
    from serving.models import ModelDeployment

    _other_node()
    ids = _load(client, operator.key, model_path=str(tiny_gguf), model_name="two", replicas=2)
    for pk in ids:
        _ready(pk)
    assert _rows("two") == [(NODE, 0, "READY", "RUNNING"), (OTHER, 1, "READY", "RUNNING")]
    # A desired count already met (0 here: nothing wanted): the away replica is left as it is.
    _load(client, operator.key, model_path=str(tiny_gguf), model_name="met", node=NODE)
    ModelDeployment.objects.filter(model_name="met").update(replicas=0)
    _offline(NODE)
    [moved] = relocate_offline()
    assert (moved.model_name, moved.new.node.name, moved.new.replica) == ("two", OTHER, 2)
    assert _rows("two") == [(NODE, 0, "UNLOADING", "STOPPED"), (OTHER, 1, "READY", "RUNNING"),
                            (OTHER, 2, "PENDING", "RUNNING")]
    assert _rows("met") == [(NODE, 0, "PENDING", "RUNNING")]


def test_a_model_without_a_deployment_row_counts_as_one_and_an_idle_one_moves_idle(client, node, operator,
                                                                                    tiny_gguf):
    from serving.control.relocation import relocate_offline
    from serving.models import ModelDeployment

    _other_node()
    [running] = _load(client, operator.key, model_path=str(tiny_gguf), model_name="legacy", node=NODE)
    _ready(running)
    ModelDeployment.objects.filter(model_name="legacy").delete()
    _load(client, operator.key, model_path=str(tiny_gguf), model_name="od", node=NODE, policy="on_demand")
    _offline(NODE)
    assert sorted(m.model_name for m in relocate_offline()) == ["legacy", "od"]
    assert _rows("legacy") == [(NODE, 0, "UNLOADING", "STOPPED"), (OTHER, 1, "PENDING", "RUNNING")]
    assert _rows("od") == [(NODE, 0, "STOPPED", "STOPPED"), (OTHER, 1, "IDLE", "IDLE")]


def test_nothing_moves_when_no_other_node_can_take_it(client, node, operator, tiny_gguf, caplog):
    from hardware.models import Node
    from serving.control.relocation import relocate_offline
    from serving.models import ScalingDecision

    [pk] = _load(client, operator.key, model_path=str(tiny_gguf), model_name="stay", node=NODE)
    _ready(pk)
    _offline(NODE)
    caplog.set_level("INFO", logger="xgen.serving")
    assert relocate_offline() == [] and relocate_offline() == []
    assert caplog.text.count("cannot move stay off node node-t: no other node agent is online") == 1
    other = _other_node()
    Node.objects.filter(pk=other.pk).update(model_memory_mib=1)  # too small for the model
    assert relocate_offline() == []
    assert _rows("stay") == [(NODE, 0, "READY", "RUNNING")], "it serves again when its node is back"
    assert not ScalingDecision.objects.exists()
    Node.objects.filter(pk=other.pk).update(model_memory_mib=0)  # room now: the next pass moves it
    assert len(relocate_offline()) == 1


def test_relocation_waits_for_a_whole_offline_window_of_good_reads():
    from django.conf import settings

    from serving.control.autoscale import may_relocate

    window = settings.NODE_OFFLINE_AFTER_S
    assert not may_relocate(None, 1000.0), "the last read failed (a database outage): wait"
    assert not may_relocate(1000.0, 1000.0 + window - 1)
    assert may_relocate(1000.0, 1000.0 + window)


def test_a_draining_node_moves_its_model_while_the_old_replica_keeps_serving_until_its_agent_drains_it(
        client, node, operator, tiny_gguf):
    """The agent's SIGTERM path (Supervisor.move_off): its node is still online; the new replica is
    placed elsewhere, the old one stays READY (its requests in flight finish) but is no longer wanted."""
    from serving.control.relocation import relocate
    from serving.models import ScalingDecision

    _other_node()
    [pk] = _load(client, operator.key, model_path=str(tiny_gguf), model_name="drained", node=NODE, autostart=True)
    _ready(pk)
    [moved] = relocate(node, why="draining (its agent got SIGTERM)", out_of_routing=False)
    assert moved.new.node.name == OTHER
    assert _rows("drained") == [(NODE, 0, "READY", "STOPPED"), (OTHER, 1, "PENDING", "RUNNING")]
    assert ScalingDecision.objects.get(model_name="drained").reason.startswith(
        "node node-t draining (its agent got SIGTERM): replica 0 moved to node-u as replica 1")
    assert relocate(node, why="draining (its agent got SIGTERM)", out_of_routing=False) == []


def test_a_draining_node_takes_no_new_load_replica_or_relocation_and_a_new_agent_clears_it(
        client, node, operator, tiny_gguf):
    """A node whose agent got SIGTERM is marked draining (Node.draining_since, stored by move_off
    before anything moves): loads, replicas and relocations go to other nodes, a load that names it
    is a 409 node_draining, and an agent registering the node again clears the mark. Before, the
    node stayed online while it drained, so a load could land on a node about to stop."""
    from hardware.models import Node
    from hardware.services import register_node
    from serving.control.relocation import relocate

    other = _other_node()
    Node.objects.filter(pk=node.pk).update(draining_since=timezone.now())
    [pk] = _load(client, operator.key, model_path=str(tiny_gguf), model_name="away-from-drain")
    assert _rows("away-from-drain") == [(OTHER, 0, "PENDING", "RUNNING")]
    r = client.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "named", "node": NODE},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code == 409 and r.json()["error"]["code"] == "node_draining", r.content
    assert "is draining" in r.json()["error"]["message"]
    _ready(pk)
    r = client.post("/api/management/scale", {"model_name": "away-from-drain", "replicas": 2},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code == 202, r.content
    assert [row[0] for row in _rows("away-from-drain")] == [OTHER, OTHER]  # not on the draining node
    # The other node going away: its replicas have nowhere to go but the draining node, which takes none.
    assert relocate(other, why="offline (test)", out_of_routing=True) == []
    nodes = {n["name"]: n for n in client.get("/api/hardware/nodes", **bearer(operator.key)).json()}
    assert nodes[NODE]["draining_since"] is not None and nodes[OTHER]["draining_since"] is None
    register_node(name=NODE, address="127.0.0.1")
    assert Node.objects.get(pk=node.pk).draining_since is None
