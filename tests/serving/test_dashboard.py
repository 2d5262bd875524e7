"""The dashboard (home page): instance states, latest events, node/GPU and model charts over
1 h / 24 h / 7 d, and its websocket pushing the newest point."""
from __future__ import annotations

import time

import pytest
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from hardware.dashboard import record_node_sample
from hardware.inventory import InventoryWorker
from hardware.models import Node
from hardware.services import save_inventory
from history.samples import ModelCounter
from serving.models import InstanceState, ModelInstance
from serving.node.agent import NodeAgent
from serving.proxy.usage import RequestContext, UsageRecorder
from serving.routing import websocket_urlpatterns
from tests.hardware.conftest import gpu_inventory

pytestmark = pytest.mark.django_db
app = URLRouter(websocket_urlpatterns)


@pytest.fixture
def as_viewer(client, viewer):
    client.force_login(viewer.user)
    return client


@pytest.fixture
def gpu_node(db) -> Node:
    Node.objects.create(name="gpu-a", address="10.0.0.5", last_heartbeat=timezone.now())
    return save_inventory(node_name="gpu-a", result=gpu_inventory(0, 1))


def test_login_is_required(client):
    response = client.get("/")
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]


def test_empty_states(as_viewer):
    html = as_viewer.get("/").content.decode()
    assert "<h1>Dashboard</h1>" in html and 'ws-connect="/ws/dashboard/1h/"' in html
    assert "No node has registered yet" in html and "No instance is running." in html
    assert "Nothing has happened yet." in html and html.count("no requests in this range") == 6


def test_gpu_node_charts_have_units_current_values_and_hover(as_viewer, gpu_node):
    inst = ModelInstance.objects.create(model_name="qwen3-4b", model_path="gguf/q", backend="vllm", node=gpu_node,
                                        gpus=[1], state=InstanceState.READY, estimated_memory_mib=8192)
    inst.events.create(from_state="WARMING", to_state="READY", message="warm-up answered")
    now = time.time()
    for dt in (60, 30, 0):
        record_node_sample("gpu-a", at=now - dt)
    html = as_viewer.get("/").content.decode()
    assert f'id="chart-{gpu_node.pk}-1h-mem"' in html and f'id="chart-{gpu_node.pk}-1h-util"' in html
    assert "GPU memory used (GiB)" in html and ">100 %</span>" in html  # the utilization axis, in %
    assert "booked by instances" in html and '<b class="current">8 GiB</b>' in html
    assert "<title>" in html and "used: 1.06 GiB" in html and "GPUs (mean of 2): " in html  # hover values
    # The node page: per GPU.
    page = as_viewer.get("/nodes/gpu-a/?range=24h").content.decode()
    assert "Memory per GPU (GiB)" in page and "gpu0 used" in page and "gpu1 booked" in page
    assert '<b class="current">8 GiB</b>' in page and 'aria-current="true">last 24h' in page
    assert '<span class="state state-READY">ready</span> <b>1</b>' in html
    assert "warm-up answered" in html and f'href="/instances/{inst.pk}/"' in html
    assert "No GPU on this node" not in html


def test_cpu_node_charts_ram_and_cpu(as_viewer):
    Node.objects.create(name="cpu-b", address="127.0.0.1", last_heartbeat=timezone.now(), memory_total_mib=16384,
                        memory_used_mib=4096, cpu_percent=12.5)
    record_node_sample("cpu-b")
    html = as_viewer.get("/?range=24h").content.decode()
    assert "No GPU on this node: RAM and CPU shown." in html and "RAM used (GiB)" in html
    assert '<b class="current">4 GiB</b>' in html and '<b class="current">12 %</b>' in html
    assert 'ws-connect="/ws/dashboard/24h/"' in html and 'aria-current="true">last 24h' in html


def test_model_charts_from_the_usage_flush(as_viewer):
    recorder = UsageRecorder()
    for ms, failed in ((30, False), (30, False), (900, True)):
        ctx = RequestContext(request_id="r", t0=time.perf_counter() - ms / 1000)
        recorder.record(ctx, model="qwen3-4b", instance_id=1, node="gpu-a", status=500 if failed else 200,
                        error=None, prompt_tokens=5, completion_tokens=30, busy_s=0.1, ttft_s=ms / 4000,
                        failed=failed)
    assert recorder.flush_sync() == 4  # one usage bucket and three request-log rows (and the model slot)
    html = as_viewer.get("/?range=7d").content.decode()
    assert html.count("no requests in this range") == 0
    assert "Requests (req/s)" in html and "Latency p99 (ms)" in html and "Time to first token p50 (ms)" in html
    assert "qwen3-4b" in html and "err/s" in html


def test_an_unknown_range_falls_back_to_an_hour(as_viewer):
    assert 'ws-connect="/ws/dashboard/1h/"' in as_viewer.get("/?range=5y").content.decode()


def test_htmx_resync_gets_the_live_parts(as_viewer, gpu_node):
    html = as_viewer.get("/", HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in html and 'id="dash-nodes" hx-swap-oob="true"' in html


@pytest.mark.django_db(transaction=True)
async def test_the_newest_point_arrives_over_the_websocket(viewer):
    comm = WebsocketCommunicator(app, "/ws/dashboard/1h/")
    comm.scope["user"] = viewer.user
    connected, _ = await comm.connect()
    assert connected
    await Node.objects.acreate(name="cpu-node", address="127.0.0.1")
    worker, agent = InventoryWorker(), NodeAgent(name="cpu-node", address="127.0.0.1", workers=[])
    await worker.start(agent)  # the inventory at start is the first sample: stored, then pushed
    node = await Node.objects.aget(name="cpu-node")
    html = await comm.receive_from(timeout=10)
    assert f'id="dash-node-{node.pk}" hx-swap-oob="true"' in html
    assert 'RAM used <b class="current">–' not in html  # the sample is on the chart
    await worker.refresh(agent)  # each refresh (every 10 s) is the next; CPU % needs two readings
    html = await comm.receive_from(timeout=10)
    assert f'id="dash-node-{node.pk}" hx-swap-oob="true"' in html
    assert 'CPU <b class="current">–' not in html and "no data in this range" not in html

    inst = await ModelInstance.objects.acreate(model_name="tiny", model_path="gguf/t", backend="llama-server",
                                               node=node, state=InstanceState.PENDING)
    from asgiref.sync import sync_to_async

    await sync_to_async(inst.mark_stopped)("stopped by the test")
    html = await comm.receive_from(timeout=10)
    while 'id="dash-states"' not in html:
        html = await comm.receive_from(timeout=10)
    assert "stopped by the test" in html and 'hx-swap-oob="true"' in html

    from serving.proxy.usage import recorder

    recorder.record(RequestContext(request_id="x"), model="tiny", instance_id=inst.pk, node="cpu-node", status=200,
                    error=None, prompt_tokens=1, completion_tokens=2, busy_s=0.0, ttft_s=0.01, failed=False)
    await recorder.flush()
    html = await comm.receive_from(timeout=10)
    while 'id="dash-models"' not in html:
        html = await comm.receive_from(timeout=10)
    assert "tiny" in html and "no requests in this range" not in html
    await comm.disconnect()


def test_model_counter_is_empty_after_take():
    c = ModelCounter()
    c.add(model="m", duration_s=0.1, ttft_s=None, prompt_tokens=0, completion_tokens=0, failed=False)
    assert len(c.take()) == 1 and c.take() == {}
