"""The GPUs page and the node page, read by a viewer."""
from __future__ import annotations

import pytest
from django.utils import timezone

from hardware.inventory import collect_inventory
from hardware.models import Node
from hardware.services import save_inventory
from serving.models import InstanceState, ModelInstance

pytestmark = pytest.mark.django_db


@pytest.fixture
def as_viewer(client, viewer):
    client.force_login(viewer.user)
    return client


def test_login_is_required(client):
    response = client.get("/gpus/")
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]
    assert client.get("/nodes/gpu-a/").status_code == 302


def test_empty_state(as_viewer):
    html = as_viewer.get("/gpus/").content.decode()
    assert "No node has registered — is the node agent running?" in html
    assert 'ws-connect="/ws/gpus/"' in html


def test_gpu_node_with_memory_bars_and_holder_link(as_viewer, gpu_node):
    inst = ModelInstance.objects.create(model_name="qwen3-4b", model_path="gguf/q", backend="vllm", node=gpu_node,
                                        gpus=[1], state=InstanceState.LOADING)
    html = as_viewer.get("/gpus/").content.decode()
    assert '<strong id="count-nodes">1</strong> <span class="muted">(1 online)</span>' in html
    assert '<strong id="count-gpus">2</strong>' in html and '<strong id="count-instances">1</strong>' in html
    assert 'class="badge status-online"' in html and "10.0.0.5" in html
    assert "543 / 81559 MiB (1 %)" in html
    assert f'href="/instances/{inst.pk}/">qwen3-4b</a>' in html
    assert "GPU memory free: <strong>162032 MiB</strong> of 163118 MiB" in html
    assert "37 %" in html and "41 °C" in html
    assert "amdsmi: libamd_smi.so not found" in html


def test_cpu_node_shows_its_detection_report(as_viewer):
    Node.objects.create(name="laptop", address="127.0.0.1", last_heartbeat=timezone.now())
    save_inventory(node_name="laptop", result=collect_inventory())
    html = as_viewer.get("/gpus/").content.decode()
    assert "No GPU detected — CPU node." in html
    assert "NVML: NVML Shared Library Not Found" in html and "torch: not compiled with CUDA" in html
    assert '<span class="role-tag">llama-cpp-python</span>' in html
    # The node page names the llama-server binary the probe found here (the cached CPU build), its
    # version and flavour.
    server = next(b for b in Node.objects.get(name="laptop").backends if b["name"] == "llama-server")
    assert server["available"], server["reason"]
    detail = as_viewer.get("/nodes/laptop/").content.decode()
    assert f"<td>{server['version']}</td><td>cpu</td><td><code>{server['path']}</code></td>" in detail


def test_htmx_poll_gets_only_the_cards(as_viewer, gpu_node):
    html = as_viewer.get("/gpus/", HTTP_HX_REQUEST="true").content.decode()
    assert html.lstrip().startswith('<div id="gpu-nodes"') and "<html" not in html


def test_node_detail(as_viewer, gpu_node):
    gpu_node.heartbeats.create(gpu_count=2, memory_used_mib=20000, instances_running=1)
    html = as_viewer.get("/nodes/gpu-a/").content.decode()
    assert '<tr data-backend="vllm"><td>vllm</td>' in html and "0.11.0" in html
    assert "llama-server: not found on PATH" in html
    assert "GPU-6d4c5e4a-8b51-7f2e-93c1-0a1b2c3d4e5f" in html and "550.54.15" in html
    assert "<td><code>amdsmi</code></td><td>did not apply</td>" in html
    assert "<td>2</td><td>20000</td><td>1</td>" in html


def test_unknown_node_is_404(as_viewer):
    assert as_viewer.get("/nodes/nope/").status_code == 404


def test_the_overview_costs_the_same_queries_for_one_node_or_twenty(django_assert_num_queries):
    from hardware.allocation import overview
    from tests.hardware.conftest import gpu_inventory

    def add_node(i: int) -> None:
        Node.objects.create(name=f"n{i:02}", address="10.0.0.1", last_heartbeat=timezone.now())
        node = save_inventory(node_name=f"n{i:02}", result=gpu_inventory(*range(8)))
        ModelInstance.objects.create(model_name=f"m{i}", model_path="gguf/m", backend="vllm", node=node,
                                     gpus=[0, 1], state=InstanceState.READY)

    add_node(0)
    with django_assert_num_queries(3):  # instances, nodes, their GPUs
        assert overview().gpu_count == 8
    for i in range(1, 20):
        add_node(i)
    with django_assert_num_queries(3):
        view = overview()
        assert view.gpu_count == 160 and view.instances_active == 20
        assert all(c.gpus[1].holder and c.gpus[2].holder is None for c in view.cards)


def test_a_node_without_inventory_yet_is_not_called_a_cpu_node(as_viewer):
    Node.objects.create(name="booting", address="10.0.0.9", last_heartbeat=timezone.now())
    for url in ("/gpus/", "/nodes/booting/"):
        html = as_viewer.get(url).content.decode()
        assert "Hardware not reported yet" in html and "CPU node" not in html


def test_a_llama_cpp_build_shows_on_the_dashboard_gpus_node_and_load_pages(client, viewer, operator):
    """Issue 28 #1: while llama.cpp compiles, every page a newcomer opens says how far it is."""
    from hardware.llama_build import BuildState

    building = BuildState(version="0.3.36", state="building", percent=45, commit="abc1234").to_json()
    Node.objects.create(name="fresh", address="127.0.0.1", last_heartbeat=timezone.now(), detector="cpu", backends=[
        {"name": "llama-server", "available": False, "version": "0 (abc1234)", "flavour": "cpu", "path": "/x",
         "reason": "llama-server: llama.cpp 0.3.36 building: 45 %", "build": building}])
    client.force_login(viewer.user)
    for url in ("/", "/gpus/", "/nodes/fresh/"):
        html = client.get(url).content.decode()
        assert "llama.cpp 0.3.36 building: 45 %" in html, url
        assert '<progress max="100" value="45"' in html, url
    client.force_login(operator.user)
    html = client.get("/instances/new/").content.decode()
    assert 'data-node="fresh"' in html and "llama.cpp 0.3.36 building: 45 %" in html
    assert "a load asked for meanwhile waits for it" in html

    failed = BuildState(version="0.3.36", state="failed", error="compiling llama-server failed").to_json()
    Node.objects.filter(name="fresh").update(backends=[
        {"name": "llama-server", "available": False, "version": "", "flavour": "cpu", "path": "/x",
         "reason": "x", "build": failed}])
    html = client.get("/nodes/fresh/").content.decode()
    assert "llama.cpp 0.3.36 build failed: compiling llama-server failed" in html
    assert 'data-build-state="failed"' in html and "<progress" not in html
