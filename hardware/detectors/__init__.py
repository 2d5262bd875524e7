"""GPU detection: AMD SMI -> NVML -> torch ROCm -> torch CUDA -> CPU; the first that applies wins."""
from __future__ import annotations

import logging

from hardware.detectors.amdsmi import AmdSmiDetector
from hardware.detectors.base import DetectionReport as DetectionReport
from hardware.detectors.base import Detector as Detector
from hardware.detectors.base import DetectorAttempt, DetectorUnavailable
from hardware.detectors.cpu import CpuDetector, read_cpu_info
from hardware.detectors.nvml import NvmlDetector
from hardware.detectors.torch_cuda import TorchCudaDetector
from hardware.detectors.torch_rocm import TorchRocmDetector

log = logging.getLogger("xgen.hardware")

# The explicit registry, in the order the chain tries them.
DETECTORS: dict[str, type[Detector]] = {
    "amdsmi": AmdSmiDetector,
    "nvml": NvmlDetector,
    "torch_rocm": TorchRocmDetector,
    "torch_cuda": TorchCudaDetector,
    "cpu": CpuDetector,
}


def default_chain() -> list[Detector]:
    """One instance of each registered detector, in order."""
    return [cls() for cls in DETECTORS.values()]


def detect(chain: list[Detector] | None = None) -> DetectionReport:
    """Try each detector in order; the first that returns GPUs (or the CPU detector) wins.

    Every detector tried is recorded with why it did not apply, so a node without GPUs can
    say why on its page. A detector that crashes unexpectedly counts as not applying.
    """
    attempts: list[DetectorAttempt] = []
    for detector in chain if chain is not None else default_chain():
        try:
            gpus = detector.detect()
        except DetectorUnavailable as exc:
            attempts.append(DetectorAttempt(detector=detector.name, ok=False, reason=str(exc)))
            continue
        except Exception as exc:  # a vendor library misbehaving must not stop the chain
            log.warning("detector %s crashed", detector.name, exc_info=True)
            attempts.append(DetectorAttempt(detector=detector.name, ok=False,
                                            reason=f"{detector.label}: {exc.__class__.__name__}: {exc}"))
            continue
        attempts.append(DetectorAttempt(detector=detector.name, ok=True,
                                        reason=f"{len(gpus)} GPU(s)" if gpus else "no GPU; CPU only"))
        return DetectionReport(detector=detector.name, gpus=gpus, cpu=read_cpu_info(), attempts=attempts)
    return DetectionReport(detector="", gpus=[], cpu=read_cpu_info(), attempts=attempts)
