"""The management API as api.md states it: load, unload, restart, instances; refusals are 4xx."""
from __future__ import annotations

import pytest
from django.test import Client

from tests.conftest import bearer
from tests.serving.conftest import LLAMA_CPP_PYTHON, NODE

pytestmark = pytest.mark.django_db


def post(client, path, body, key):
    return client.post(f"/api/management/{path}", body, content_type="application/json", **bearer(key))


def err(r, status):
    assert r.status_code == status, (r.status_code, r.content[:400])
    body = r.json()
    assert set(body["error"]) == {"message", "type", "code"}
    return body["error"]


def test_load_answers_202_with_the_choice(client: Client, node, operator, tiny_gguf):
    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "tiny"}, operator.key)
    assert r.status_code == 202, r.content
    body = r.json()
    assert set(body) == {"id", "model_name", "state", "backend", "backend_reason", "node", "gpus",
                         "policy", "idle_ttl_s", "pinned", "max_concurrency", "autostart",  # issue 13
                         "first_byte_timeout_s",  # issue 23
                         "replica", "replicas", "replicas_wanted", "partial", "refused"}  # issue 30
    assert (body["policy"], body["pinned"], body["max_concurrency"]) == ("always", False, None)
    assert body["state"] == "PENDING" and body["backend"] == "llama-cpp-python" and body["node"] == NODE
    assert body["gpus"] == [] and body["backend_reason"] == (
        "GGUF on CPU-only -> llama-cpp-python (cpu): llama-server (cpu) is not installed on node-t; "
        "context 2,048 tokens, the model's own (on node-t)")
    one = client.get(f"/api/management/instances/{body['id']}", **bearer(operator.key)).json()
    for field in ("state", "error", "port", "pid", "restarts", "ready_at", "log_tail"):
        assert field in one
    assert [i["id"] for i in client.get("/api/management/instances", **bearer(operator.key)).json()] == [body["id"]]
    # The same served name twice among active instances: 409.
    e = err(post(client, "load", {"model_path": str(tiny_gguf), "model_name": "tiny"}, operator.key), 409)
    assert e["code"] == "duplicate_model_name" and "tiny" in e["message"]


def test_a_load_sets_the_models_own_first_byte_timeout(client, node, operator, tiny_gguf):
    """Issue 23: a model with long prompts waits longer for its first byte than the proxy's
    setting; the load stores it, the answers show it, the routing table hands it to the client."""
    from serving.proxy.replicas import _read_rows

    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "long-prefill",
                              "first_byte_timeout_s": 1800}, operator.key)
    assert r.status_code == 202 and r.json()["first_byte_timeout_s"] == 1800, r.content
    one = client.get(f"/api/management/instances/{r.json()['id']}", **bearer(operator.key)).json()
    assert one["first_byte_timeout_s"] == 1800
    from serving.models import ModelInstance

    ModelInstance.objects.filter(pk=one["id"]).update(state="READY", port=1)
    rows, _, _ = _read_rows()  # what the routing table makes its Backend of (a test through it: test_http1_*)
    assert [row["first_byte_timeout_s"] for row in rows if row["model_name"] == "long-prefill"] == [1800]
    plain = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "plain"}, operator.key).json()
    assert plain["first_byte_timeout_s"] is None  # the proxy's XGEN_PROXY_FIRST_BYTE_TIMEOUT
    for bad in (0, -5, 86401, "soon"):
        r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "x", "first_byte_timeout_s": bad},
                 operator.key)
        assert 400 <= r.status_code < 500, (bad, r.status_code)


def test_default_name_and_unload_by_name(client, node, operator, tiny_gguf):
    r = post(client, "load", {"model_path": str(tiny_gguf)}, operator.key)
    assert r.status_code == 202 and r.json()["model_name"] == "tiny-llama"
    r = post(client, "unload", {"model_name": "tiny-llama"}, operator.key)
    assert r.status_code == 202 and r.json()["desired_state"] == "STOPPED"
    # Never started: it is STOPPED at once, and its name is free again.
    assert r.json()["state"] == "STOPPED"
    assert post(client, "load", {"model_path": str(tiny_gguf)}, operator.key).status_code == 202


@pytest.mark.parametrize("body,status,needle", [
    ({"model_path": "gguf/../../etc"}, 400, ".."),
    ({"model_path": "/models/../etc/passwd"}, 400, ".."),
    ({"model_path": "/nonexistent/model.gguf"}, 400, "not under XGEN_IMPORT_DIRS"),
    ({"model_path": "/etc/hostname"}, 400, "not under XGEN_IMPORT_DIRS"),
    ({"model_path": "/tmp/xgen-no-such-dir/model.gguf"}, 400, "does not exist on the server"),
    ({"model_path": "gguf/not-in-store"}, 400, "no model 'gguf/not-in-store' in the store"),
    ({"model_path": "relative/path"}, 400, "gguf/, huggingface/ or lora/"),
    ({"model_path": ""}, 400, "empty"),
    ({"model_path": "TINY", "model_name": "bad name; rm"}, 400, "model_name"),
    ({"model_path": "TINY", "server_type": "vision"}, 400, "server_type"),
    ({"model_path": "TINY", "extra_args": {"--model": "/etc/passwd"}}, 400, "--model"),
    ({"model_path": "TINY", "extra_args": {"--n_ctx": "1\n2"}}, 400, "newline"),
    ({"model_path": "TINY", "backend": "vllm"}, 400, "vllm cannot serve a gguf"),
    ({"model_path": "TINY", "node": "nowhere"}, 400, "unknown node 'nowhere'"),
    ({"model_path": "TINY", "gpus": [0]}, 400, "runs on the CPU"),
    ({"model_path": "TINY", "tensor_parallel_size": 0}, 400, "tensor_parallel_size"),
    ({"model_name": "x"}, 400, "model_path"),
])
def test_bad_loads_are_refused_clearly(client, node, operator, tiny_gguf, body, status, needle):
    if body.get("model_path") == "TINY":
        body = {**body, "model_path": str(tiny_gguf)}
    e = err(post(client, "load", body, operator.key), status)
    assert needle in e["message"], e
    from serving.models import ModelInstance

    assert ModelInstance.objects.count() == 0, "no half-written state"


def test_offline_node_is_409(client, node, operator, tiny_gguf):
    from datetime import timedelta

    from django.utils import timezone

    type(node).objects.filter(pk=node.pk).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    e = err(post(client, "load", {"model_path": str(tiny_gguf), "node": NODE}, operator.key), 409)
    assert e["code"] == "node_offline" and "offline" in e["message"]
    e = err(post(client, "load", {"model_path": str(tiny_gguf)}, operator.key), 409)
    assert "no node agent is online" in e["message"]


def test_gpu_node_places_and_refuses_with_numbers(client, node, operator, tiny_gguf):
    from hardware.models import GpuDevice

    node.backends = [{"name": "llama-server", "available": True, "version": "b6500", "flavour": "cuda",
                      "path": "/opt/llama-server", "reason": ""}, LLAMA_CPP_PYTHON]
    node.save()
    GpuDevice.objects.create(node=node, index=0, vendor="NVIDIA", type="NVIDIA", name="L4",
                             memory_total_mib=24000, memory_used_mib=23800)
    GpuDevice.objects.create(node=node, index=1, vendor="NVIDIA", type="NVIDIA", name="L4",
                             memory_total_mib=24000, memory_used_mib=1000)
    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "g"}, operator.key)
    assert r.status_code == 202, r.content
    assert r.json()["gpus"] == [1] and r.json()["backend"] == "llama-server"
    assert r.json()["backend_reason"] == ("GGUF on NVIDIA -> llama-server (cuda); context 2,048 tokens, the model's "
                                          "own; 16 slots sharing one KV cache of that context, for many users at once "
                                          "(with llama-server's own 4, 12 of 16 chats wait: TTFT p50 5.3 s against "
                                          "2.4 s) (on node-t)")
    GpuDevice.objects.filter(index=1).update(memory_used_mib=23900)
    e = err(post(client, "load", {"model_path": str(tiny_gguf), "model_name": "h"}, operator.key), 409)
    assert e["code"] == "does_not_fit"
    assert e["message"].startswith("needs ~0.5 GiB, largest free is 0.2 GiB on gpu 0 of node-t")


def test_roles(client, node, viewer, operator, tiny_gguf):
    e = err(post(client, "load", {"model_path": str(tiny_gguf)}, viewer.key), 403)
    assert e["code"] == "insufficient_role"
    assert client.get("/api/management/instances", **bearer(viewer.key)).status_code == 200
    err(client.post("/api/management/load", {"model_path": str(tiny_gguf)}, content_type="application/json"), 401)
    r = post(client, "load", {"model_path": str(tiny_gguf)}, operator.key)
    err(post(client, "unload", {"id": r.json()["id"]}, viewer.key), 403)
    err(post(client, "restart", {"id": r.json()["id"]}, viewer.key), 403)


def test_unknown_instances(client, node, operator):
    assert err(client.get("/api/management/instances/999", **bearer(operator.key)), 404)["code"] == "instance_not_found"
    err(post(client, "unload", {"id": 999}, operator.key), 404)
    err(post(client, "unload", {"model_name": "ghost"}, operator.key), 404)
    err(post(client, "unload", {}, operator.key), 400)


def test_a_node_that_has_not_reported_yet_is_409(client, node, operator, tiny_gguf):
    type(node).objects.filter(pk=node.pk).update(backends=[], detector="")
    e = err(post(client, "load", {"model_path": str(tiny_gguf)}, operator.key), 409)
    assert e["code"] == "node_not_ready" and "not reported its hardware" in e["message"]
