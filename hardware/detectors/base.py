"""What every GPU detector returns, and the base class the detectors share.

A detector either returns the GPUs it found or raises `DetectorUnavailable` with a
one-line reason; the unified chain (hardware.detectors.detect) records that reason.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any

GPU_TYPE_NVIDIA = "NVIDIA"
GPU_TYPE_AMD_CDNA = "AMD_CDNA"
GPU_TYPE_AMD_RDNA = "AMD_RDNA"

# CDNA (Instinct) targets: MI100 gfx908, MI200 gfx90a, MI300 gfx94x, MI350 gfx95x.
_CDNA_GFX = re.compile(r"^gfx(908|90a|94\d|95\d)$")


class DetectorUnavailable(Exception):
    """The detector does not apply on this machine; str(exc) says why."""


@dataclass
class DetectedGpu:
    index: int
    uuid: str
    vendor: str
    type: str
    name: str
    arch: str = ""
    driver_version: str = ""
    memory_total_mib: int = 0
    memory_used_mib: int = 0
    utilization_pct: float | None = None
    temperature_c: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (for JSON and tests)."""
        return asdict(self)


@dataclass
class CpuInfo:
    cores: int
    memory_total_mib: int
    memory_used_mib: int
    percent: float | None = None  # use since the previous sample; None on the first


@dataclass
class DetectorAttempt:
    detector: str
    ok: bool
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"detector": self.detector, "ok": self.ok, "reason": self.reason}


@dataclass
class DetectionReport:
    """The chain's outcome: which detector won, its GPUs, the CPU, and why the others did not apply."""

    detector: str
    gpus: list[DetectedGpu]
    cpu: CpuInfo
    attempts: list[DetectorAttempt] = field(default_factory=list)

    def attempts_as_dicts(self) -> list[dict[str, Any]]:
        """The per-detector rows stored in Node.detection_report."""
        return [a.as_dict() for a in self.attempts]


def amd_gpu_type(gfx: str) -> str:
    """AMD_CDNA for Instinct targets (gfx908/gfx90a/gfx94x/gfx95x), AMD_RDNA for the rest."""
    target = gfx.split(":", 1)[0].strip().lower()  # torch reports "gfx942:sramecc+:xnack-"
    return GPU_TYPE_AMD_CDNA if _CDNA_GFX.match(target) else GPU_TYPE_AMD_RDNA


def bytes_to_mib(value: int | float | None) -> int:
    """Bytes to whole MiB (None -> 0)."""
    return int(value or 0) // (1024 * 1024)


def as_text(value: object) -> str:
    """Libraries return str or bytes depending on their version; always give str."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return "" if value is None else str(value)


class Detector(ABC):
    """One way of finding GPUs. `detect()` returns them or raises DetectorUnavailable."""

    name: str = "detector"
    label: str = "detector"  # how reasons are prefixed ("NVML: ...")

    @abstractmethod
    def detect(self) -> list[DetectedGpu]:
        """The GPUs this detector sees; raises DetectorUnavailable when it does not apply."""

    def unavailable(self, reason: str) -> DetectorUnavailable:
        """A DetectorUnavailable whose message carries this detector's label."""
        return DetectorUnavailable(f"{self.label}: {reason}")
