"""GET /api/hardware/nodes: the contract in shared/api.md."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from hardware.models import Node
from serving.models import InstanceState, ModelInstance
from tests.conftest import bearer

pytestmark = pytest.mark.django_db

GPU_KEYS = {"index", "uuid", "vendor", "type", "name", "memory_total_mib", "memory_used_mib", "utilization_pct",
            "instance_id"}


def test_nodes_with_gpus_and_holders(client, viewer, gpu_node):
    held = ModelInstance.objects.create(model_name="qwen", model_path="gguf/qwen", backend="vllm", node=gpu_node,
                                        gpus=[1], state=InstanceState.READY)
    ModelInstance.objects.create(model_name="old", model_path="gguf/old", backend="vllm", node=gpu_node,
                                 gpus=[0], state=InstanceState.STOPPED)
    Node.objects.create(name="gpu-b", address="10.0.0.6",
                        last_heartbeat=timezone.now() - timedelta(seconds=30))  # stale
    response = client.get("/api/hardware/nodes", **bearer(viewer.key))
    assert response.status_code == 200
    body = response.json()
    assert [n["name"] for n in body] == ["gpu-a", "gpu-b"]
    a, b = body
    assert set(a) == {"name", "address", "status", "last_heartbeat", "draining_since", "backends", "llama_build", "gpus"}
    assert (a["address"], a["status"], a["backends"]) == ("10.0.0.5", "online", ["vllm"])
    assert a["llama_build"] is None  # no llama.cpp build runs there
    assert all(set(g) == GPU_KEYS for g in a["gpus"])
    assert [(g["index"], g["instance_id"]) for g in a["gpus"]] == [(0, None), (1, held.pk)]
    assert a["gpus"][0] | {"instance_id": None} == {
        "index": 0, "uuid": "GPU-6d4c5e4a-8b51-7f2e-93c1-0a1b2c3d4e5f", "vendor": "NVIDIA", "type": "NVIDIA",
        "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559, "memory_used_mib": 543,
        "utilization_pct": 37.0, "instance_id": None}
    assert (b["status"], b["gpus"], b["backends"]) == ("stale", [], [])


def test_offline_and_never_seen_nodes(client, viewer):
    Node.objects.create(name="old", address="x", last_heartbeat=timezone.now() - timedelta(hours=1))
    Node.objects.create(name="new", address="y")
    body = client.get("/api/hardware/nodes", **bearer(viewer.key)).json()
    assert [(n["name"], n["status"]) for n in body] == [("new", "offline"), ("old", "offline")]
    assert body[0]["last_heartbeat"] is None and body[1]["last_heartbeat"].startswith("20")


def test_empty_list_when_no_node(client, viewer):
    response = client.get("/api/hardware/nodes", **bearer(viewer.key))
    assert response.status_code == 200 and response.json() == []


def test_credentials_are_required(client, gpu_node):
    response = client.get("/api/hardware/nodes")
    assert response.status_code == 401
    assert set(response.json()["error"]) == {"message", "type", "code"}
    assert client.get("/api/hardware/nodes", HTTP_AUTHORIZATION="Bearer xgen_wrong").status_code == 401
