"""AMD GPUs through a ROCm build of PyTorch (when AMD SMI is not usable)."""
from __future__ import annotations

from hardware.detectors.base import DetectedGpu, Detector
from hardware.detectors.torch_cuda import import_torch, read_torch_devices, torch_wheel_build


class TorchRocmDetector(Detector):
    name = "torch_rocm"
    label = "torch"

    def detect(self) -> list[DetectedGpu]:
        if torch_wheel_build() in ("cpu", "cuda"):
            raise self.unavailable("no ROCm build")  # known from metadata, without importing torch
        torch = import_torch(self)
        if not getattr(torch.version, "hip", None):
            raise self.unavailable("no ROCm build")
        return read_torch_devices(torch, self, rocm=True)
