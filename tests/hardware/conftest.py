"""Fixtures for the hardware tests: a registered node with recorded GPUs."""
from __future__ import annotations

import pytest
from django.utils import timezone

from hardware.detectors.base import CpuInfo, DetectionReport, DetectorAttempt
from hardware.detectors.nvml import parse_nvml_device
from hardware.inventory import InventoryResult
from hardware.models import Node
from hardware.services import save_inventory
from tests.hardware import recorded


def gpu_inventory(*gpu_indexes: int) -> InventoryResult:
    """An inventory of H100s (recorded NVML values) at the given indexes."""
    gpus = [parse_nvml_device(i, **recorded.NVML_H100) for i in gpu_indexes]
    report = DetectionReport(
        detector="nvml", gpus=gpus, cpu=CpuInfo(cores=64, memory_total_mib=515000, memory_used_mib=20000),
        attempts=[DetectorAttempt("amdsmi", False, "amdsmi: libamd_smi.so not found"),
                  DetectorAttempt("nvml", True, f"{len(gpus)} GPU(s)")],
    )
    backends = [
        {"name": "vllm", "available": True, "version": "0.11.0", "flavour": "cuda", "path": "/usr/bin/vllm", "reason": ""},
        {"name": "llama-server", "available": False, "version": "", "flavour": "", "path": "",
         "reason": "llama-server: not found on PATH"},
    ]
    return InventoryResult(report=report, backends=backends)


@pytest.fixture
def gpu_node(db) -> Node:
    """gpu-a: online, two H100s."""
    Node.objects.create(name="gpu-a", address="10.0.0.5", last_heartbeat=timezone.now())
    return save_inventory(node_name="gpu-a", result=gpu_inventory(0, 1))
