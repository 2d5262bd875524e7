"""NVIDIA GPUs through a CUDA build of PyTorch (when NVML is not usable)."""
from __future__ import annotations

import importlib.metadata
from typing import Any

from hardware.detectors.base import (
    GPU_TYPE_NVIDIA,
    DetectedGpu,
    Detector,
    DetectorUnavailable,
    amd_gpu_type,
    as_text,
    bytes_to_mib,
)


def torch_wheel_build() -> str:
    """The build named in torch's installed version ("2.13.0+cpu" -> "cpu", "+rocm6.2" -> "rocm",
    "+cu124" -> "cuda"); "" when not installed or not named (PyPI's Linux default is CUDA)."""
    try:
        local = importlib.metadata.version("torch").partition("+")[2].lower()
    except importlib.metadata.PackageNotFoundError:
        return ""
    if local.startswith("rocm"):
        return "rocm"
    if local.startswith("cu"):
        return "cuda"
    return "cpu" if local == "cpu" else ""


def import_torch(detector: Detector) -> Any:
    """torch, or DetectorUnavailable("torch: not installed")."""
    try:
        import torch
    except (ImportError, OSError) as exc:
        raise detector.unavailable(f"not installed ({exc.__class__.__name__})") from None
    return torch


def parse_torch_device(index: int, props: Any, *, free_bytes: int | None, rocm: bool) -> DetectedGpu:
    """A DetectedGpu from torch.cuda.get_device_properties() and mem_get_info()'s free bytes."""
    total = bytes_to_mib(props.total_memory)
    used = total - bytes_to_mib(free_bytes) if free_bytes is not None else 0
    uuid = as_text(getattr(props, "uuid", ""))
    if rocm:
        gfx = as_text(getattr(props, "gcnArchName", "")).split(":", 1)[0]
        return DetectedGpu(index=index, uuid=uuid, vendor="AMD", type=amd_gpu_type(gfx), name=as_text(props.name),
                           arch=gfx, memory_total_mib=total, memory_used_mib=max(0, used))
    return DetectedGpu(index=index, uuid=uuid, vendor="NVIDIA", type=GPU_TYPE_NVIDIA, name=as_text(props.name),
                       arch=f"{props.major}.{props.minor}", memory_total_mib=total, memory_used_mib=max(0, used))


def read_torch_devices(torch: Any, detector: Detector, *, rocm: bool) -> list[DetectedGpu]:
    """Every device torch.cuda sees (CUDA or HIP behind the same API)."""
    if not torch.cuda.is_available():
        raise detector.unavailable(f"{'ROCm' if rocm else 'CUDA'} build but no GPU is visible")
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        try:
            free, _total = torch.cuda.mem_get_info(index)
        except RuntimeError:
            free = None
        gpus.append(parse_torch_device(index, props, free_bytes=free, rocm=rocm))
    if not gpus:
        raise DetectorUnavailable(f"{detector.label}: no devices")
    return gpus


class TorchCudaDetector(Detector):
    name = "torch_cuda"
    label = "torch"

    def detect(self) -> list[DetectedGpu]:
        if torch_wheel_build() in ("cpu", "rocm"):
            # Known from package metadata: skip importing torch (~200 MiB, 1.3 s) into the agent.
            raise self.unavailable("ROCm build, not CUDA" if torch_wheel_build() == "rocm" else "not compiled with CUDA")
        torch = import_torch(self)
        if getattr(torch.version, "hip", None):
            raise self.unavailable("ROCm build, not CUDA")
        if not getattr(torch.version, "cuda", None):
            raise self.unavailable("not compiled with CUDA")
        return read_torch_devices(torch, self, rocm=False)
