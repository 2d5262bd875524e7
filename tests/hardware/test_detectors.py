"""Detectors: parsing of recorded vendor values, the chain's order, and the real chain here."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hardware.detectors import DETECTORS, detect
from hardware.detectors.amdsmi import AmdSmiDetector, parse_amdsmi_device
from hardware.detectors.base import DetectedGpu, Detector, DetectorUnavailable, amd_gpu_type
from hardware.detectors.cpu import CpuDetector, parse_meminfo, read_cpu_info
from hardware.detectors.nvml import NvmlDetector, parse_nvml_device
from hardware.detectors.torch_cuda import (
    TorchCudaDetector,
    parse_torch_device,
    read_torch_devices,
    torch_wheel_build,
)
from hardware.detectors.torch_rocm import TorchRocmDetector
from tests.hardware import recorded


def test_nvml_h100_is_parsed():
    gpu = parse_nvml_device(0, **recorded.NVML_H100)
    assert gpu == DetectedGpu(
        index=0, uuid="GPU-6d4c5e4a-8b51-7f2e-93c1-0a1b2c3d4e5f", vendor="NVIDIA", type="NVIDIA",
        name="NVIDIA H100 80GB HBM3", arch="9.0", driver_version="550.54.15",
        memory_total_mib=81559, memory_used_mib=543, utilization_pct=37.0, temperature_c=41.0,
    )


def test_nvml_h200_with_bytes_and_unsupported_metrics():
    gpu = parse_nvml_device(3, **recorded.NVML_H200_BYTES)
    assert (gpu.index, gpu.name, gpu.uuid, gpu.driver_version) == (
        3, "NVIDIA H200", "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "560.35.03")
    assert gpu.memory_total_mib == 143771 and gpu.memory_used_mib == 508
    assert gpu.utilization_pct is None and gpu.temperature_c is None


def test_amdsmi_mi300x_is_cdna():
    gpu = parse_amdsmi_device(0, **recorded.AMDSMI_MI300X)
    assert gpu == DetectedGpu(
        index=0, uuid="2dff74a1-0000-1000-807f-1a2b3c4d5e6f", vendor="AMD", type="AMD_CDNA",
        name="AMD Instinct MI300X", arch="gfx942", driver_version="6.8.5",
        memory_total_mib=196592, memory_used_mib=283, utilization_pct=0.0, temperature_c=38.0,
    )


def test_amdsmi_rx7900xtx_is_rdna_and_na_metrics_are_none():
    gpu = parse_amdsmi_device(1, **recorded.AMDSMI_RX7900XTX)
    assert (gpu.type, gpu.arch, gpu.name, gpu.vendor) == ("AMD_RDNA", "gfx1100", "Radeon RX 7900 XTX", "AMD")
    assert (gpu.memory_total_mib, gpu.memory_used_mib, gpu.utilization_pct) == (24560, 1240, 3.0)
    assert gpu.temperature_c is None  # "N/A" from amdsmi


@pytest.mark.parametrize(("gfx", "expected"), [
    ("gfx908", "AMD_CDNA"), ("gfx90a", "AMD_CDNA"), ("gfx940", "AMD_CDNA"), ("gfx942", "AMD_CDNA"),
    ("gfx950", "AMD_CDNA"), ("gfx942:sramecc+:xnack-", "AMD_CDNA"), ("gfx1100", "AMD_RDNA"),
    ("gfx1030", "AMD_RDNA"), ("gfx1201", "AMD_RDNA"), ("gfx900", "AMD_RDNA"),
])
def test_amd_type_from_gfx(gfx, expected):
    assert amd_gpu_type(gfx) == expected


def test_torch_device_properties_are_parsed_for_cuda_and_rocm():
    h100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85520809984, major=9, minor=0, uuid="abc")
    gpu = parse_torch_device(0, h100, free_bytes=84950908928, rocm=False)
    assert (gpu.type, gpu.arch, gpu.memory_total_mib, gpu.memory_used_mib) == ("NVIDIA", "9.0", 81559, 544)
    mi300 = SimpleNamespace(name="AMD Instinct MI300X", total_memory=206141652992, gcnArchName="gfx942:sramecc+:xnack-",
                            major=9, minor=4)
    gpu = parse_torch_device(2, mi300, free_bytes=None, rocm=True)
    assert (gpu.vendor, gpu.type, gpu.arch, gpu.memory_total_mib) == ("AMD", "AMD_CDNA", "gfx942", 196592)


def test_meminfo_is_parsed():
    text = "MemTotal:       24684312 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"
    assert parse_meminfo(text) == (24105, (24684312 - 20000000) // 1024)


# ---------------------------------------------------------------- the chain
class ScriptedDetector(Detector):
    """Hardware stand-in: finds the given GPUs, or does not apply for the given reason."""

    def __init__(self, name: str, *, gpus: list[DetectedGpu] | None = None, reason: str = "", crash: bool = False):
        self.name = self.label = name
        self.gpus, self.reason, self.crash, self.calls = gpus, reason, crash, 0

    def detect(self) -> list[DetectedGpu]:
        self.calls += 1
        if self.crash:
            raise RuntimeError("driver went away")
        if self.gpus is None:
            raise self.unavailable(self.reason)
        return self.gpus


H100 = parse_nvml_device(0, **recorded.NVML_H100)


def test_registry_order_is_the_documented_chain():
    assert list(DETECTORS) == ["amdsmi", "nvml", "torch_rocm", "torch_cuda", "cpu"]
    assert [cls for cls in DETECTORS.values()] == [AmdSmiDetector, NvmlDetector, TorchRocmDetector,
                                                   TorchCudaDetector, CpuDetector]


def test_first_success_wins_and_later_detectors_are_not_tried():
    first = ScriptedDetector("a", reason="no library")
    second = ScriptedDetector("b", gpus=[H100])
    third = ScriptedDetector("c", gpus=[])
    report = detect([first, second, third])
    assert report.detector == "b" and report.gpus == [H100]
    assert third.calls == 0
    assert report.attempts_as_dicts() == [
        {"detector": "a", "ok": False, "reason": "a: no library"},
        {"detector": "b", "ok": True, "reason": "1 GPU(s)"},
    ]
    assert report.cpu.cores >= 1 and report.cpu.memory_total_mib > 0


def test_a_crashing_detector_is_recorded_and_the_chain_goes_on():
    report = detect([ScriptedDetector("x", crash=True), ScriptedDetector("y", reason="nope"), CpuDetector()])
    assert report.detector == "cpu" and report.gpus == []
    reasons = [a["reason"] for a in report.attempts_as_dicts()]
    assert reasons == ["x: RuntimeError: driver went away", "y: nope", "no GPU; CPU only"]


def test_the_real_chain_here_reaches_cpu_with_every_reason():
    report = detect()
    assert report.detector == "cpu" and report.gpus == []
    rows = {a["detector"]: a for a in report.attempts_as_dicts()}
    assert list(rows) == ["amdsmi", "nvml", "torch_rocm", "torch_cuda", "cpu"]
    assert not any(rows[name]["ok"] for name in ("amdsmi", "nvml", "torch_rocm", "torch_cuda"))
    assert rows["amdsmi"]["reason"] in ("amdsmi: amdsmi not installed", "amdsmi: libamd_smi.so not found")
    assert rows["nvml"]["reason"] == "NVML: NVML Shared Library Not Found"
    assert rows["torch_rocm"]["reason"] == "torch: no ROCm build"
    assert rows["torch_cuda"]["reason"] == "torch: not compiled with CUDA"
    assert rows["cpu"]["ok"] is True
    info = read_cpu_info()
    assert report.cpu.cores == info.cores and info.memory_total_mib > info.memory_used_mib > 0


def test_torch_build_is_read_from_metadata_here():
    # The CPU wheel: the torch detectors decide without importing torch into the agent.
    assert torch_wheel_build() == "cpu"


def test_the_torch_device_reader_on_the_real_torch():
    import torch

    with pytest.raises(DetectorUnavailable, match="^torch: CUDA build but no GPU is visible$"):
        read_torch_devices(torch, TorchCudaDetector(), rocm=False)
