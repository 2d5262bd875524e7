"""A node's inventory carries the agent run it came from (issue 32 #5): a load planned just after
an agent restart waits for the fresh probe instead of reading the previous run's backends, or
answers 503 node_starting with Retry-After; /readyz is not ready until the local agent's first
inventory is saved. The agent, its inventory worker, the backend probe and planning are real; the
first detector of the chain is held (as a slow GPU library would be) to keep the probe running."""
from __future__ import annotations

import asyncio
import threading

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from hardware.detectors import CpuDetector
from hardware.detectors.base import CpuInfo, DetectedGpu, DetectionReport, Detector
from hardware.inventory import InventoryResult, InventoryWorker
from hardware.models import Node
from hardware.services import LOCAL_AGENT_RUNS, register_node, save_inventory
from serving.node.agent import NodeAgent
from tests.conftest import bearer

PREVIOUS_RUN_BACKENDS = [{"name": "llama-cpp-python", "available": True, "version": "0.0.1-previous-run",
                          "flavour": "cpu", "path": "", "reason": ""}]


def _inventory(version: str) -> InventoryResult:
    report = DetectionReport(detector="cpu", gpus=[], cpu=CpuInfo(cores=4, memory_total_mib=16000,
                                                                  memory_used_mib=4000), attempts=[])
    return InventoryResult(report=report, backends=[{**PREVIOUS_RUN_BACKENDS[0], "version": version}])


class HeldDetector(Detector):
    """A detector that answers only once the test lets it (then: no such GPU, the CPU detector wins)."""

    name = label = "held"

    def __init__(self) -> None:
        self.release = threading.Event()

    def detect(self) -> list[DetectedGpu]:
        self.release.wait(60)
        raise self.unavailable("not here")


def _load(client, key: str, tiny_gguf, name: str):
    return client.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": name},
                       content_type="application/json", **bearer(key))


@pytest.mark.django_db
def test_a_load_on_a_node_whose_agent_restarted_is_refused_until_the_new_run_saved_its_inventory(
        client, operator, settings, tiny_gguf):
    from serving.control.planning import stored_plan
    from serving.models import ModelInstance

    settings.INVENTORY_WAIT_S = 0
    register_node(name=settings.NODE_NAME, address="127.0.0.1", run="run-1")
    save_inventory(node_name=settings.NODE_NAME, result=_inventory("0.0.1-previous-run"), run="run-1")
    r = _load(client, operator.key, tiny_gguf, "first")
    assert r.status_code == 202, r.content
    # The agent restarts (another llama-cpp-python now): its registration makes the stored inventory stale.
    register_node(name=settings.NODE_NAME, address="127.0.0.1", run="run-2")
    r = _load(client, operator.key, tiny_gguf, "too-early")
    assert r.status_code == 503 and r["Retry-After"] == "5", r.content
    assert r.json()["error"]["code"] == "node_starting" and r.json()["error"]["type"] == "service_unavailable"
    assert not ModelInstance.objects.filter(model_name="too-early").exists()
    save_inventory(node_name=settings.NODE_NAME, result=_inventory("0.3.36"), run="run-2")
    r = _load(client, operator.key, tiny_gguf, "after-the-probe")
    assert r.status_code == 202, r.content
    node = Node.objects.get(name=settings.NODE_NAME)
    assert (node.inventory_run, node.agent_run) == ("run-2", "run-2") and node.inventory_at is not None
    assert stored_plan(ModelInstance.objects.get(model_name="after-the-probe")).version == "0.3.36"


@pytest.mark.django_db
def test_among_several_nodes_one_still_starting_is_passed_over_and_all_starting_is_a_503(
        client, operator, settings, tiny_gguf):
    settings.INVENTORY_WAIT_S = 0
    for name in (settings.NODE_NAME, "other-node"):
        register_node(name=name, address="127.0.0.1", run="run-1")
        save_inventory(node_name=name, result=_inventory("0.3.36"), run="run-1")
    register_node(name="other-node", address="127.0.0.1", run="run-2")  # restarted, probe not saved yet
    r = client.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "placed"},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code == 202 and r.json()["node"] == settings.NODE_NAME, r.content
    register_node(name=settings.NODE_NAME, address="127.0.0.1", run="run-2")
    r = client.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "nowhere-yet"},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code == 503 and r.json()["error"]["code"] == "node_starting", r.content
    assert r["Retry-After"] == "5"


@pytest.mark.django_db(transaction=True)
async def test_a_load_just_after_an_agent_start_waits_for_its_probe_and_readyz_waits_too(settings, tiny_gguf):
    from serving.control.planning import plan_load

    settings.INVENTORY_WAIT_S = 30
    name = settings.NODE_NAME
    await sync_to_async(register_node)(name=name, address="127.0.0.1", run="previous")
    await sync_to_async(save_inventory)(node_name=name, result=_inventory("0.0.1-previous-run"), run="previous")
    held = HeldDetector()
    agent = NodeAgent(name=name, address="127.0.0.1", workers=[InventoryWorker(chain=[held, CpuDetector()])])
    assert agent.run_id
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        for _ in range(200):  # registered: the row names the new run, the inventory is still the last run's
            node = await Node.objects.aget(name=name)
            if node.agent_run == agent.run_id:
                break
            await asyncio.sleep(0.05)
        assert node.agent_run == agent.run_id and node.inventory_run == "previous"
        ready = await AsyncClient().get("/readyz")
        assert ready.status_code == 503, ready.content
        assert f"node agent {name} has not saved its first inventory yet" in ready.json()["reasons"]
        plan = asyncio.create_task(sync_to_async(plan_load, thread_sensitive=False)(
            model_path=str(tiny_gguf), model_name="waits"))
        await asyncio.sleep(0.5)
        assert not plan.done()  # waiting for the probe, not planning on the previous run's backends
        held.release.set()
        planned = await asyncio.wait_for(plan, 60)
        assert planned.launch.version != "0.0.1-previous-run" and planned.launch.backend == "llama-server"
        await asyncio.wait_for(agent.started.wait(), 60)
        node = await Node.objects.aget(name=name)
        assert node.inventory_run == agent.run_id
        ready = await AsyncClient().get("/readyz")
        assert ready.status_code == 200, ready.content
    finally:
        held.release.set()
        stop.set()
        await asyncio.wait_for(task, 60)
    assert name not in LOCAL_AGENT_RUNS  # a stopped agent leaves nothing to wait for


def test_an_agent_without_the_hardware_worker_registers_no_run():
    assert NodeAgent(name="bare", address="127.0.0.1", workers=[]).run_id == ""
