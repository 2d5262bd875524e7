"""The load decision is made once (serving.control.planning): the Load page's verdict, the stored plan and
the API's `command` are the same."""
from __future__ import annotations

import sys

import pytest

from serving.control.planning import MODEL_SLOT, PORT_SLOT, PYTHON_SLOT, LaunchPlan
from tests.conftest import bearer
from tests.serving.conftest import NODE

pytestmark = pytest.mark.django_db

LLAMA_SERVER_CUDA = {"name": "llama-server", "available": True, "version": "b6500", "flavour": "cuda",
                     "path": "/opt/llama-server", "reason": ""}


def _load(client, key, body):
    return client.post("/api/management/load", body, content_type="application/json", **bearer(key))


def test_the_stored_plan_is_what_the_verdict_showed(client, node, operator, tiny_gguf):
    client.force_login(operator.user)
    query = {"model_path": str(tiny_gguf), "model_name": "planned", "extra_args": "--n_ctx 512"}
    verdict = client.get("/instances/new/verdict", query).content.decode()
    r = _load(client, operator.key, {"model_path": str(tiny_gguf), "model_name": "planned",
                                     "extra_args": {"--n_ctx": "512"}})
    assert r.status_code == 202, r.content
    from serving.models import ModelInstance

    inst = ModelInstance.objects.get(pk=r.json()["id"])
    plan = LaunchPlan.from_json(inst.plan)
    assert (plan.backend, plan.flavour, plan.version, plan.format) == ("llama-cpp-python", "cpu", "0.3.16", "gguf")
    assert plan.gpus == () and plan.gpu_type == "" and plan.host == "127.0.0.1"
    assert plan.argv[plan.argv.index("--port") + 1] == PORT_SLOT
    assert plan.argv[plan.argv.index("--model") + 1] == MODEL_SLOT
    assert plan.argv[:3] == (PYTHON_SLOT, "-m", "llama_cpp.server"), "the node's interpreter, not the web's"
    assert plan.env == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    assert plan.estimate_mib == inst.estimated_memory_mib and plan.reason in inst.backend_reason
    # This process is node-t's agent too (all-in-one): its interpreter is the backend's.
    shown = plan.command_line(model=str(tiny_gguf), python=sys.executable)
    assert shown in verdict.replace("&#x27;", "'") and "--port {port}" in shown
    # The API shows the argv as planned, the model path filled in (the port once the agent picks it).
    one = client.get(f"/api/management/instances/{inst.pk}", **bearer(operator.key)).json()
    assert one["command"] == plan.command(model=str(tiny_gguf), python=sys.executable)
    assert one["command"][one["command"].index("--n_ctx") + 1] == "512"
    assert PORT_SLOT in one["command"]
    type(inst).objects.filter(pk=inst.pk).update(port=18555)
    one = client.get(f"/api/management/instances/{inst.pk}", **bearer(operator.key)).json()
    assert one["command"][one["command"].index("--port") + 1] == "18555"


def test_another_nodes_interpreter_stays_a_placeholder(client, node, operator, serving_settings):
    serving_settings.NODE_NAME = "web-only"  # a web process on another host than node-t's agent
    client.force_login(operator.user)
    verdict = client.get("/instances/new/verdict", {"model_path": "/models/tiny.gguf", "node": NODE}).content.decode()
    assert "{python} -m llama_cpp.server" in verdict and sys.executable not in verdict
    r = _load(client, operator.key, {"model_path": "/models/tiny.gguf", "model_name": "remote", "node": NODE})
    assert r.status_code == 202, r.content
    one = client.get(f"/api/management/instances/{r.json()['id']}", **bearer(operator.key)).json()
    assert one["command"][0] == PYTHON_SLOT
    assert one["command"][one["command"].index("--model") + 1] == "/models/tiny.gguf"


def test_a_plan_round_trips_through_json(node, tiny_gguf):
    from serving.control.planning import plan_load

    plan = plan_load(model_path=str(tiny_gguf), model_name="rt", server_type="embedding").launch
    assert LaunchPlan.from_json(plan.to_json()) == plan
    assert plan.is_embedding and "--embedding" in plan.argv
    with pytest.raises(ValueError):
        LaunchPlan.from_json({"backend": "vllm"})


def test_a_gpu_plan_holds_the_gpus_and_their_visibility(node, tiny_gguf):
    from hardware.models import GpuDevice
    from serving.control.planning import plan_load

    node.backends = [LLAMA_SERVER_CUDA]
    node.save()
    for i, used in ((0, 20000), (1, 1000)):
        GpuDevice.objects.create(node=node, index=i, vendor="NVIDIA", type="NVIDIA", name="L4",
                                 memory_total_mib=24000, memory_used_mib=used)
    plan = plan_load(model_path=str(tiny_gguf), model_name="g").launch
    assert plan.gpus == (1,) and plan.gpu_type == "NVIDIA" and plan.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert plan.executable == "/opt/llama-server" and plan.argv[0] == "/opt/llama-server"


def test_a_cpu_backend_on_a_gpu_node_is_told_to_see_no_gpu(node, tiny_gguf):
    from hardware.models import GpuDevice
    from serving.control.planning import plan_load

    GpuDevice.objects.create(node=node, index=0, vendor="NVIDIA", type="NVIDIA", name="L4",
                             memory_total_mib=24000, memory_used_mib=1000)
    plan = plan_load(model_path=str(tiny_gguf), model_name="c").launch
    assert plan.backend == "llama-cpp-python" and plan.gpus == ()
    assert plan.env["CUDA_VISIBLE_DEVICES"] == ""


def test_backends_that_share_a_cpu_split_its_cores(client, node, operator, tiny_gguf):
    """Issue 28 #2, the default threads from the node: the first llama.cpp backend on a 4-core CPU
    keeps the engine's own (every core); the next ones get 4 // backends there (a stopped one and
    a backend on a GPU do not count), and a plan made again does not count its own instance."""
    from serving.control.planning import replan_instance
    from serving.models import ModelInstance
    from tests.serving.conftest import node_backends, set_backends

    type(node).objects.filter(pk=node.pk).update(cpu_count=4)
    set_backends(NODE, node_backends())

    def load(name: str, backend: str) -> ModelInstance:
        r = _load(client, operator.key, {"model_path": str(tiny_gguf), "model_name": name, "backend": backend})
        assert r.status_code == 202, r.content
        return ModelInstance.objects.get(pk=r.json()["id"])

    first = load("one", "llama-server")
    assert "--threads" not in first.plan["argv"] and "thread" not in first.backend_reason
    second = load("two", "llama-server")
    argv = second.plan["argv"]
    assert argv[argv.index("--threads") + 1] == "2", argv
    assert "2 threads: its share of the node's 4 cores with 1 other llama.cpp backend on the CPU" in \
        second.backend_reason
    ModelInstance.objects.filter(pk=first.pk).update(gpus=[0])  # as if on a GPU: not on the CPU
    stopped = load("three", "llama-cpp-python")
    ModelInstance.objects.filter(pk=stopped.pk).update(state="STOPPED", desired_state="STOPPED")
    ModelInstance.objects.filter(pk=first.pk).update(gpus=[])
    fourth = load("four", "llama-cpp-python")
    argv = fourth.plan["argv"]
    assert argv[argv.index("--n_threads") + 1] == "1" and argv[argv.index("--n_threads_batch") + 1] == "1", argv
    plan, _ = replan_instance(second, None)  # itself, "one" and "four" share the 4 cores: 4 // 3
    assert plan.argv[plan.argv.index("--threads") + 1] == "1"
