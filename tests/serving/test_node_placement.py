"""A load without a node goes where it fits, preferring a node that already caches the model;
the reason is part of the answer."""
from __future__ import annotations

import pytest

from tests.conftest import bearer
from tests.serving.conftest import LLAMA_CPP_PYTHON

pytestmark = pytest.mark.django_db

LLAMA_SERVER_CUDA = {"name": "llama-server", "available": True, "version": "b6500", "flavour": "cuda",
                     "path": "/opt/llama-server", "reason": ""}


def _node(name: str, *, backends: list[dict], gpus_used: list[tuple[int, int]] = (), ram=(65536, 1024)):
    from hardware.models import GpuDevice
    from hardware.services import register_node

    node = register_node(name=name, address="127.0.0.1")
    node.backends = backends
    node.detector = "nvml" if gpus_used else "cpu"
    node.memory_total_mib, node.memory_used_mib = ram
    node.save()
    for index, (total, used) in enumerate(gpus_used):
        GpuDevice.objects.create(node=node, index=index, vendor="NVIDIA", type="NVIDIA", name="L4",
                                 memory_total_mib=total, memory_used_mib=used)
    return node


def _load(client, operator, body):
    return client.post("/api/management/load", body, content_type="application/json", **bearer(operator.key))


def test_the_node_with_room_is_chosen(client, operator, serving_settings, tiny_gguf):
    _node("full-gpus", backends=[LLAMA_SERVER_CUDA], gpus_used=[(24000, 23900)])
    _node("roomy-gpus", backends=[LLAMA_SERVER_CUDA], gpus_used=[(24000, 23000), (80000, 1000)])
    r = _load(client, operator, {"model_path": str(tiny_gguf), "model_name": "m1"})
    assert r.status_code == 202, r.content
    body = r.json()
    assert (body["node"], body["gpus"]) == ("roomy-gpus", [1])
    assert "placed on roomy-gpus: it has the most room" in body["backend_reason"]


def test_a_node_that_caches_the_model_wins(client, operator, serving_settings):
    from hub.models import CacheEntry, CacheState, ModelArtifact

    ModelArtifact.objects.create(prefix="gguf/tiny", format="gguf", name="tiny", size_bytes=600_000,
                                 file_count=1, complete=True)
    _node("big-cpu", backends=[LLAMA_CPP_PYTHON], ram=(512000, 1000))
    cached = _node("small-cpu", backends=[LLAMA_CPP_PYTHON], ram=(16000, 8000))
    CacheEntry.objects.create(node=cached, prefix="gguf/tiny", state=CacheState.READY)
    r = _load(client, operator, {"model_path": "gguf/tiny", "model_name": "m2"})
    assert r.status_code == 202, r.content
    assert r.json()["node"] == "small-cpu"
    assert "placed on small-cpu: it already caches the model (1 other node(s) could run it)" in r.json()["backend_reason"]


def test_when_no_node_fits_the_answer_says_why_per_node(client, operator, serving_settings, tiny_gguf):
    _node("n1", backends=[LLAMA_SERVER_CUDA], gpus_used=[(24000, 23990)])
    _node("n2", backends=[LLAMA_SERVER_CUDA], gpus_used=[(16000, 15990)])
    r = _load(client, operator, {"model_path": str(tiny_gguf), "model_name": "m3"})
    assert r.status_code == 409
    message = r.json()["error"]["message"]
    assert message.startswith("no online node can run it:")
    assert "of n1" in message and "of n2" in message
