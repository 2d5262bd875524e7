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


@pytest.fixture
def node(serving_settings):
    from hardware.services import register_node

    n = register_node(name=NODE, address="127.0.0.1")
    n.backends = [LLAMA_CPP_PYTHON]
    n.save()
    return n


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
