"""The inventory: saved by a real NodeAgent run and by refreshes; vanished GPUs removed."""
from __future__ import annotations

import asyncio

import pytest

from hardware import inventory
from hardware.detectors import CpuDetector
from hardware.detectors.base import DetectedGpu, Detector
from hardware.inventory import InventoryWorker
from hardware.models import GpuDevice, Node
from hardware.services import save_inventory
from serving.node.agent import NodeAgent, default_workers
from tests.hardware.conftest import gpu_inventory


class SwitchableGpus(Detector):
    """Hardware stand-in whose GPUs the test changes between refreshes."""

    name = label = "switchable"

    def __init__(self, gpus: list[DetectedGpu]):
        self.gpus = gpus

    def detect(self) -> list[DetectedGpu]:
        if not self.gpus:
            raise self.unavailable("device lost")
        return self.gpus


def _gpu(index: int, used: int) -> DetectedGpu:
    return DetectedGpu(index=index, uuid=f"GPU-{index}", vendor="NVIDIA", type="NVIDIA", name="NVIDIA H200",
                       arch="9.0", memory_total_mib=143771, memory_used_mib=used, utilization_pct=5.0)


def test_the_agent_registry_has_the_hardware_worker():
    assert [w.name for w in default_workers()].count("hardware") == 1


@pytest.mark.django_db(transaction=True)
async def test_a_real_agent_run_saves_this_cpu_node():
    agent = NodeAgent(name="cpu-node", address="127.0.0.1", workers=[InventoryWorker()])
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await asyncio.wait_for(agent.started.wait(), 60)
    stop.set()
    await asyncio.wait_for(task, 30)

    node = await Node.objects.aget(name="cpu-node")
    assert node.detector == "cpu"
    assert [a["detector"] for a in node.detection_report] == ["amdsmi", "nvml", "torch_rocm", "torch_cuda", "cpu"]
    assert node.detection_report[1]["reason"] == "NVML: NVML Shared Library Not Found"
    assert node.cpu_count >= 1 and node.memory_total_mib > node.memory_used_mib > 0
    assert "llama-cpp-python" in node.backend_names
    assert {b["name"] for b in node.backends} == {"vllm", "llama-server", "llama-cpp-python"}
    assert await GpuDevice.objects.filter(node=node).acount() == 0


@pytest.mark.django_db(transaction=True)
async def test_refresh_updates_metrics_and_removes_vanished_gpus():
    await Node.objects.acreate(name="n1", address="127.0.0.1")
    hardware = SwitchableGpus([_gpu(0, 100), _gpu(1, 200)])
    worker = InventoryWorker(chain=[hardware, CpuDetector()])
    agent = NodeAgent(name="n1", address="127.0.0.1", workers=[])
    await worker.start(agent)
    assert [(g.index, g.memory_used_mib) async for g in GpuDevice.objects.filter(node__name="n1")] == [(0, 100), (1, 200)]
    node = await Node.objects.aget(name="n1")
    assert node.detector == "switchable" and node.backends  # the probe ran at start

    hardware.gpus = [_gpu(0, 5000)]
    await worker.refresh(agent)
    assert [(g.index, g.memory_used_mib) async for g in GpuDevice.objects.filter(node__name="n1")] == [(0, 5000)]
    assert (await Node.objects.aget(name="n1")).backends == node.backends  # refreshes keep the probe

    hardware.gpus = []
    await worker.refresh(agent)
    node = await Node.objects.aget(name="n1")
    assert await GpuDevice.objects.filter(node=node).acount() == 0
    assert node.detection_report[-1] == {"detector": "switchable", "ok": False,
                                         "reason": "refresh failed: switchable: device lost"}


@pytest.mark.django_db
def test_save_inventory_upserts_by_index(gpu_node):
    first_ids = list(GpuDevice.objects.filter(node=gpu_node).values_list("pk", flat=True))
    save_inventory(node_name="gpu-a", result=gpu_inventory(0, 1, 2))
    rows = list(GpuDevice.objects.filter(node=gpu_node).order_by("index"))
    assert [g.index for g in rows] == [0, 1, 2] and [g.pk for g in rows[:2]] == first_ids
    assert rows[0].memory_total_mib == 81559 and rows[0].arch == "9.0" and rows[0].driver_version == "550.54.15"
    gpu_node.refresh_from_db()
    assert gpu_node.cpu_count == 64 and gpu_node.backend_names == ["vllm"]


@pytest.mark.django_db
def test_save_inventory_for_an_unknown_node_writes_nothing():
    with pytest.raises(Node.DoesNotExist):
        save_inventory(node_name="ghost", result=gpu_inventory(0))
    assert not GpuDevice.objects.exists()


@pytest.mark.django_db(transaction=True)
async def test_backends_are_reprobed_every_few_refreshes(monkeypatch):
    monkeypatch.setattr(inventory, "BACKEND_REPROBE_EVERY", 2)
    await Node.objects.acreate(name="n2", address="127.0.0.1")
    worker = InventoryWorker(chain=[CpuDetector()])
    agent = NodeAgent(name="n2", address="127.0.0.1", workers=[])
    await worker.start(agent)
    await Node.objects.filter(name="n2").aupdate(backends=[])  # as if llama-cpp-python were installed later
    await worker.refresh(agent)
    assert (await Node.objects.aget(name="n2")).backends == []
    await worker.refresh(agent)
    assert "llama-cpp-python" in (await Node.objects.aget(name="n2")).backend_names
