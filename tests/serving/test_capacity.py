"""Capacity and eviction through the management API (issue 13): a GPU node recorded as the
detector reports it, a node capped by XGEN_NODE_MEMORY_MIB, and on_demand instances brought to
READY with the state changes the agent makes (each tiny model is estimated at 514 MiB)."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from tests.conftest import bearer
from tests.serving.conftest import LLAMA_CPP_PYTHON, NODE

pytestmark = pytest.mark.django_db
LLAMA_SERVER_CUDA = {"name": "llama-server", "available": True, "version": "b6500", "flavour": "cuda",
                     "path": "/opt/llama-server", "reason": ""}


def post(client: Client, path: str, body: dict, key: str):
    return client.post(f"/api/management/{path}", body, content_type="application/json", **bearer(key))


def ready(pk: int, *, used_ago_s: float, gpus: list[int] | None = None) -> None:
    """Walk the instance to READY as its node agent would, last used `used_ago_s` ago."""
    from serving.models import ModelInstance

    inst = ModelInstance.objects.get(pk=pk)
    if inst.state == "IDLE":
        ModelInstance.objects.filter(pk=pk).update(desired_state="RUNNING")
        inst.mark_pending("started by a request")
    inst.mark_loading(pid=0, pgid=0, port=28999 - pk, gpus=gpus or [], message="starting")
    inst.mark_warming()
    inst.mark_ready("ready")
    ModelInstance.objects.filter(pk=pk).update(last_request_at=timezone.now() - timedelta(seconds=used_ago_s))


def row(pk: int):
    from serving.models import InstanceEvent, ModelInstance

    inst = ModelInstance.objects.get(pk=pk)
    return inst, list(InstanceEvent.objects.filter(instance=inst).values_list("message", flat=True))


def test_a_capped_node_evicts_the_least_recently_used_on_demand_model(client, node, operator, tiny_gguf):
    type(node).objects.filter(pk=node.pk).update(model_memory_mib=1100)  # room for two
    ids = {}
    for name in ("old", "new"):
        r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": name, "policy": "on_demand",
                                  "start": True}, operator.key)
        assert r.status_code == 202 and r.json()["state"] == "PENDING", r.content
        ids[name] = r.json()["id"]
    ready(ids["old"], used_ago_s=300)
    ready(ids["new"], used_ago_s=5)
    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "clicked"}, operator.key)
    assert r.status_code == 202, r.content
    old, old_events = row(ids["old"])
    new, _ = row(ids["new"])
    assert old.desired_state == "IDLE" and "evicted to make room for clicked (514 MiB needed)" in old_events
    assert new.desired_state == "RUNNING", "only as much as needed is evicted, least recently used first"
    # An always instance and a pinned one are never evicted: the next load is refused with the numbers.
    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "pinned", "policy": "on_demand",
                              "pinned": True}, operator.key)
    assert r.status_code == 202 and r.json()["state"] == "IDLE"
    from serving.models import ModelInstance

    ModelInstance.objects.filter(pk=ids["new"]).update(pinned=True)
    r = post(client, "start", {"id": r.json()["id"]}, operator.key)
    assert r.status_code == 409, r.content
    error = r.json()["error"]
    assert error["code"] == "does_not_fit"
    assert "pinned needs 514 MiB; node-t has 72 MiB free of 1100 MiB offered to models" in error["message"]
    assert "clicked (instance" in error["message"] and '"needed_mib": 514' in error["message"]


def test_a_model_larger_than_the_node_offers_is_refused_at_registration(client, node, operator, tiny_gguf):
    type(node).objects.filter(pk=node.pk).update(model_memory_mib=300)
    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "big", "policy": "on_demand"},
             operator.key)
    assert r.status_code == 409 and r.json()["error"]["code"] == "does_not_fit", r.content
    assert "offers 300 MiB to models in all" in r.json()["error"]["message"]


def test_on_a_gpu_the_on_demand_model_holding_it_is_evicted_and_a_pinned_one_is_not(client, node, operator,
                                                                                     tiny_gguf):
    from hardware.models import GpuDevice

    node.backends = [LLAMA_SERVER_CUDA, LLAMA_CPP_PYTHON]
    node.save()
    gpu = GpuDevice.objects.create(node=node, index=0, vendor="NVIDIA", type="NVIDIA", name="L4",
                                   memory_total_mib=1000, memory_used_mib=0)
    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "a", "policy": "on_demand"}, operator.key)
    assert r.status_code == 202 and r.json()["state"] == "IDLE" and r.json()["gpus"] == [], r.content
    a = r.json()["id"]
    ready(a, used_ago_s=60, gpus=[0])
    GpuDevice.objects.filter(pk=gpu.pk).update(memory_used_mib=600)  # what the detector sees with A loaded
    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "b"}, operator.key)
    assert r.status_code == 202 and r.json()["gpus"] == [0], r.content
    inst, events = row(a)
    assert inst.desired_state == "IDLE" and "evicted to make room for b (514 MiB needed)" in events
    # The same with A pinned: B does not fit on the GPU and nothing else may go.
    from serving.models import ModelInstance

    post(client, "unload", {"model_name": "b"}, operator.key)
    ModelInstance.objects.filter(pk=a).update(desired_state="RUNNING", pinned=True)
    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "c"}, operator.key)
    assert r.status_code == 409 and r.json()["error"]["code"] == "does_not_fit", r.content


# ---------------------------------------------------------------- the figure a start is checked with (32 #2)
def _measured(pk: int, mib: int) -> None:
    """What the agent records once the instance is READY (serving.control.planning.record_measurement)."""
    from serving.control.planning import record_measurement, stored_plan
    from serving.models import ModelInstance

    inst = ModelInstance.objects.get(pk=pk)
    record_measurement(pk, plan=stored_plan(inst), extra_args=inst.extra_args, measured_mib=mib, source="rss",
                       node_name=NODE)


def _two_of_one_shape(client, node, operator, tiny_gguf) -> tuple[int, int]:
    """A and B: on_demand, the same model, backend and context; A READY and measured at 81 MiB,
    then the node capped at 121 MiB (room for one of them at the measured figure, none at 514)."""
    ids = []
    for name in ("shape-a", "shape-b"):
        r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": name, "policy": "on_demand",
                                  "extra_args": {"--n_ctx": 256}}, operator.key)
        assert r.status_code == 202 and r.json()["state"] == "IDLE", r.content
        ids.append(r.json()["id"])
    a, b = ids
    ready(a, used_ago_s=300)
    _measured(a, 81)
    type(node).objects.filter(pk=node.pk).update(model_memory_mib=121)
    return a, b


def test_a_start_uses_the_measurement_of_its_shape_and_says_so(client, node, operator, tiny_gguf):
    a, b = _two_of_one_shape(client, node, operator, tiny_gguf)
    assert row(b)[0].estimated_memory_mib > 121  # its estimate, stored before A was measured
    r = post(client, "start", {"id": b}, operator.key)
    assert r.status_code == 202, r.content  # before: 409 "shape-b needs 513 MiB"
    inst_a, a_events = row(a)
    inst_b, b_events = row(b)
    assert inst_a.desired_state == "IDLE" and "evicted to make room for shape-b (81 MiB needed)" in a_events
    assert inst_b.state == "PENDING" and inst_b.memory_mib == 81  # booked at the figure it was checked with
    assert any("memory for the fit check: 81 MiB, measured for the same model, backend and context on "
               f"{NODE}" in e for e in b_events), b_events


def test_a_refused_start_names_the_figure_in_the_answer_and_the_timeline(client, node, operator, tiny_gguf):
    from serving.models import ModelInstance

    a, b = _two_of_one_shape(client, node, operator, tiny_gguf)
    ModelInstance.objects.filter(pk=a).update(pinned=True)
    for _ in range(2):
        r = post(client, "start", {"id": b}, operator.key)
        assert r.status_code == 409 and r.json()["error"]["code"] == "does_not_fit", r.content
    message = r.json()["error"]["message"]
    assert "shape-b needs 81 MiB; node-t has 40 MiB free of 121 MiB offered to models" in message, message
    assert "81 MiB is measured for the same model, backend and context on node-t" in message, message
    _, events = row(b)
    refusals = [e for e in events if e.startswith("start refused: shape-b needs 81 MiB")]
    assert len(refusals) == 1, events  # once, however many requests are refused alike


def test_its_own_measurement_goes_before_the_shape_and_the_estimate_comes_last(client, node, operator, tiny_gguf):
    from serving.control.capacity import start_memory
    from serving.models import MemoryMeasurement, ModelInstance

    a, b = _two_of_one_shape(client, node, operator, tiny_gguf)
    inst_b = ModelInstance.objects.get(pk=b)
    assert (start_memory(inst_b).mib, start_memory(inst_b).source) == (81, "shape")
    ModelInstance.objects.filter(pk=b).update(measured_memory_mib=90, measured_source="rss")
    inst_b.refresh_from_db()
    assert (start_memory(inst_b).mib, start_memory(inst_b).source) == (90, "measured")
    assert "measured by this instance" in start_memory(inst_b).basis
    MemoryMeasurement.objects.all().delete()
    inst_a = ModelInstance.objects.get(pk=a)
    ModelInstance.objects.filter(pk=a).update(measured_memory_mib=None)
    inst_a.refresh_from_db()
    assert (start_memory(inst_a).mib, start_memory(inst_a).source) == (inst_a.estimated_memory_mib, "estimate")


def test_a_restart_and_an_autostart_check_the_fit_with_the_shape_figure(client, node, operator, tiny_gguf):
    from serving.control.services import start_again
    from serving.models import ModelInstance

    a, b = _two_of_one_shape(client, node, operator, tiny_gguf)
    # B stopped (an unload of an IDLE instance) and restarted: the restart is a start, checked at 81 MiB.
    assert post(client, "unload", {"id": b}, operator.key).status_code == 202
    assert row(b)[0].state == "STOPPED"
    r = post(client, "restart", {"id": b}, operator.key)
    assert r.status_code == 202 and r.json()["state"] == "PENDING", r.content
    inst_a, a_events = row(a)
    assert inst_a.desired_state == "IDLE" and "evicted to make room for shape-b (81 MiB needed)" in a_events
    assert any("restart requested; memory for the fit check: 81 MiB, measured for the same model"
               in e for e in row(b)[1])
    # An autostart instance stopped with its agent starts again with the next one (start_again):
    # with B booked at 81 MiB of the 121 there is no room for A (pinned B: nothing to evict), so it stays
    # STOPPED and nothing waits for it, the refusal and the figure in its timeline.
    ModelInstance.objects.filter(pk=b).update(pinned=True)
    inst_b = ModelInstance.objects.get(pk=b)
    inst_b.mark_loading(pid=0, pgid=0, port=28990, gpus=[], message="starting")
    ModelInstance.objects.filter(pk=a).update(policy="always", autostart=True, desired_state="RUNNING")
    inst_a.refresh_from_db()
    inst_a.mark_stopped("node agent stopped (autostart: starts with the next agent)")
    assert start_again(a, "starting it again on this node") is None
    inst_a, a_events = row(a)
    assert (inst_a.state, inst_a.desired_state) == ("STOPPED", "STOPPED")
    assert "81 MiB is measured by this instance" in a_events[-1] and a_events[-1].startswith("start refused"), a_events
    ModelInstance.objects.filter(pk=b).update(pinned=False, desired_state="STOPPED", state="STOPPED")
    ModelInstance.objects.filter(pk=a).update(desired_state="RUNNING")
    started = start_again(a, "starting it again on this node")
    assert started is not None and started.state == "PENDING"
    assert "memory for the fit check: 81 MiB, measured by this instance" in row(a)[1][-1]
