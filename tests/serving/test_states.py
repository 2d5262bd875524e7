"""State changes go through ModelInstance's mark_* methods, checked against one table; progress
ticks never write a state the instance has left and do not re-render the list card."""
from __future__ import annotations

import ast
import re

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from serving.models import (
    TRANSITIONS,
    DesiredState,
    IllegalTransition,
    InstanceEvent,
    InstanceState,
    ModelInstance,
)
from tests.conftest import REPO

S = InstanceState


def _instance(node, name="st", **fields) -> ModelInstance:
    return ModelInstance.create_requested(message="load requested", model_name=name, model_path="/m/x.gguf",
                                          backend="llama-cpp-python", node=node, **fields)


def _timeline(inst) -> list[tuple[str, str]]:
    return list(InstanceEvent.objects.filter(instance=inst).values_list("from_state", "to_state"))


def test_the_table_covers_every_state_and_names_only_states():
    assert set(TRANSITIONS) == set(S.values)
    for targets in TRANSITIONS.values():
        assert targets <= set(S.values)
    assert TRANSITIONS[S.STOPPED] == {S.PENDING}, "a stopped instance only ever starts again through PENDING"
    # An on_demand instance stopped for idleness or evicted goes back to IDLE (issue 13).
    assert TRANSITIONS[S.UNLOADING] == {S.STOPPED, S.IDLE}
    assert TRANSITIONS[S.IDLE] == {S.PENDING, S.STOPPED}, "an idle instance starts through PENDING, or is unloaded"


@pytest.mark.django_db
def test_an_on_demand_life_goes_idle_pending_ready_unloading_idle(node):
    inst = ModelInstance.create_requested(message="registered on_demand", state=S.IDLE, model_name="od",
                                          model_path="/m/tiny.gguf", backend="llama-cpp-python", node=node,
                                          policy="on_demand", idle_ttl_s=60, desired_state="IDLE")
    assert inst.state == S.IDLE and inst.on_demand and inst.idle_text.startswith("idle")
    ModelInstance.objects.filter(pk=inst.pk).update(desired_state="RUNNING")
    inst.mark_pending("started by a request")
    inst.mark_loading(pid=4242, pgid=4242, port=18123, gpus=[], message="starting")
    inst.mark_warming()
    inst.mark_ready("ready on port 18123")
    assert inst.idle_unload_at is not None and "unloads in" in inst.idle_text
    inst.mark_unloading("idle unload: no request for 60 s")
    inst.mark_idle("idle unload: no request for 60 s", exit_code=-15)
    row = ModelInstance.objects.get(pk=inst.pk)
    assert (row.state, row.pid, row.port, row.gpus) == (S.IDLE, None, None, [])
    assert _timeline(inst) == [("", "IDLE"), ("IDLE", "PENDING"), ("PENDING", "LOADING"), ("LOADING", "WARMING"),
                               ("WARMING", "READY"), ("READY", "UNLOADING"), ("UNLOADING", "IDLE")]


@pytest.mark.django_db
def test_a_whole_life_writes_one_event_per_transition(node):
    inst = _instance(node)
    inst.mark_caching(0.0)
    assert inst.set_progress(40.0) and inst.state_message == "copying from the store: 40%"
    inst.mark_loading(pid=4242, pgid=4242, port=18123, gpus=[], message="starting")
    inst.mark_warming()
    inst.mark_ready("ready on port 18123")
    inst.mark_unloading("unload requested")
    inst.mark_stopped("unload requested", exit_code=-15)
    row = ModelInstance.objects.get(pk=inst.pk)
    assert (row.state, row.pid, row.pgid, row.port, row.gpus, row.exit_code) == (S.STOPPED, None, None, None, [], -15)
    assert row.stopped_at and row.ready_at and row.progress_pct is None
    assert _timeline(inst) == [("", "PENDING"), ("PENDING", "CACHING"), ("CACHING", "LOADING"),
                               ("LOADING", "WARMING"), ("WARMING", "READY"), ("READY", "UNLOADING"),
                               ("UNLOADING", "STOPPED")]


@pytest.mark.django_db
@pytest.mark.parametrize("start,move", [
    (S.STOPPED, lambda i: i.mark_caching(0.0)),
    (S.STOPPED, lambda i: i.mark_loading(pid=1, pgid=1, port=18001, gpus=[], message="x")),
    (S.STOPPED, lambda i: i.mark_unloading("x")),
    (S.UNLOADING, lambda i: i.mark_ready("x")),
    (S.PENDING, lambda i: i.mark_ready("x")),
    (S.READY, lambda i: i.mark_caching(0.0)),
    (S.ERROR, lambda i: i.mark_warming()),
])
def test_an_illegal_transition_raises_and_writes_nothing(node, start, move):
    inst = _instance(node)
    ModelInstance.objects.filter(pk=inst.pk).update(state=start)
    inst.refresh_from_db()
    before = _timeline(inst)
    with pytest.raises(IllegalTransition):
        move(inst)
    assert ModelInstance.objects.get(pk=inst.pk).state == start
    assert _timeline(inst) == before


@pytest.mark.django_db
def test_pending_only_for_an_instance_that_should_run(node):
    inst = _instance(node)
    inst.mark_stopped("unloaded")
    ModelInstance.objects.filter(pk=inst.pk).update(desired_state=DesiredState.STOPPED)
    with pytest.raises(IllegalTransition):
        inst.mark_pending("restarting")
    inst.mark_pending("restart requested", desired_state=DesiredState.RUNNING)
    assert ModelInstance.objects.get(pk=inst.pk).state == S.PENDING


@pytest.mark.django_db
def test_a_progress_tick_never_writes_a_state_the_instance_has_left(node):
    # Issue 17 #7: a copy's late tick took an unloaded instance from STOPPED back to CACHING.
    inst = _instance(node)
    inst.mark_caching(0.0)
    late = ModelInstance.objects.get(pk=inst.pk)  # what the copy thread holds
    inst.mark_unloading("unload requested")
    inst.mark_stopped("unload requested")
    assert late.set_progress(77.0) is False
    row = ModelInstance.objects.get(pk=inst.pk)
    assert row.state == S.STOPPED and row.progress_pct is None and row.state_message == "unload requested"


def test_only_the_model_writes_state():
    """No code but serving/models.py sets an instance's state (tests and migrations aside)."""
    writes = []
    for path in sorted((REPO / "serving").rglob("*.py")):
        if "migrations" in path.parts or path == REPO / "serving" / "models.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr == "state":
                        writes.append(f"{path.relative_to(REPO)}:{node.lineno}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("update", "create", "update_or_create", "get_or_create") and \
                    any(k.arg == "state" for k in node.keywords):
                writes.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert writes == [], "state written outside serving/models.py:\n" + "\n".join(writes)
    text = (REPO / "serving" / "node" / "supervisor.py").read_text()
    assert not re.search(r"\bpid=None\b", text), "the process fields are cleared by the model, not by hand"


@pytest.mark.django_db(transaction=True)
async def test_a_progress_tick_updates_the_state_block_not_the_list_card(node, viewer):
    from serving.web.consumers import InstanceConsumer, InstancesConsumer

    inst = await sync_to_async(_instance)(node, "tick")
    await sync_to_async(inst.mark_caching)(10.0)
    listing = WebsocketCommunicator(InstancesConsumer.as_asgi(), "/ws/instances/")
    listing.scope["user"] = viewer.user
    one = WebsocketCommunicator(InstanceConsumer.as_asgi(), f"/ws/instances/{inst.pk}/")
    one.scope["user"] = viewer.user
    one.scope["url_route"] = {"kwargs": {"pk": inst.pk}}
    assert (await listing.connect())[0] and (await one.connect())[0]

    assert await sync_to_async(inst.set_progress)(55.0)
    cell = await listing.receive_from(timeout=3)
    assert cell.startswith(f'<div id="inst-row-state-{inst.pk}"') and 'hx-swap-oob="true"' in cell
    assert "CACHING 55%" in cell and "instances-card" not in cell
    state = await one.receive_from(timeout=3)
    assert f'id="inst-state-{inst.pk}"' in state and "copying from the store: 55%" in state
    assert 'id="timeline"' not in state, "a tick is no transition: no timeline row"
    assert await listing.receive_nothing(timeout=0.5) and await one.receive_nothing(timeout=0.3)

    # A state change still re-renders the whole card (its counts change with it).
    await sync_to_async(lambda: inst.mark_loading(pid=4242, pgid=4242, port=18123, gpus=[], message="starting"))()
    card = await listing.receive_from(timeout=3)
    assert card.startswith('<div id="instances-card"') and f'id="inst-row-state-{inst.pk}"' in card
    assert "LOADING" in card
    await listing.disconnect()
    await one.disconnect()
