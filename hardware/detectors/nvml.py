"""NVIDIA GPUs through NVML (pynvml, from the nvidia-ml-py package)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hardware.detectors.base import (
    GPU_TYPE_NVIDIA,
    DetectedGpu,
    Detector,
    as_text,
    bytes_to_mib,
)


def parse_nvml_device(
    index: int,
    *,
    name: Any,
    uuid: Any,
    memory: Any,
    utilization: Any | None,
    temperature: Any | None,
    capability: tuple[int, int] | None,
    driver_version: Any,
) -> DetectedGpu:
    """Turn what pynvml returns for one device into a DetectedGpu.

    memory: nvmlDeviceGetMemoryInfo's struct (total/used/free in bytes); utilization:
    nvmlDeviceGetUtilizationRates' struct (.gpu in %); capability: (major, minor).
    """
    return DetectedGpu(
        index=index,
        uuid=as_text(uuid),
        vendor="NVIDIA",
        type=GPU_TYPE_NVIDIA,
        name=as_text(name),
        arch=f"{capability[0]}.{capability[1]}" if capability else "",
        driver_version=as_text(driver_version),
        memory_total_mib=bytes_to_mib(memory.total),
        memory_used_mib=bytes_to_mib(memory.used),
        utilization_pct=float(utilization.gpu) if utilization is not None else None,
        temperature_c=float(temperature) if temperature is not None else None,
    )


class NvmlDetector(Detector):
    name = "nvml"
    label = "NVML"

    def detect(self) -> list[DetectedGpu]:
        try:
            import pynvml
        except ImportError:
            raise self.unavailable("pynvml not installed (nvidia-ml-py)") from None
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as exc:
            raise self.unavailable(str(exc) or exc.__class__.__name__) from None
        try:
            return self._read_all(pynvml)
        except pynvml.NVMLError as exc:
            raise self.unavailable(f"query failed: {exc}") from None
        finally:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass

    def _read_all(self, pynvml: Any) -> list[DetectedGpu]:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            raise self.unavailable("no NVIDIA devices")
        driver = pynvml.nvmlSystemGetDriverVersion()

        def optional(fn: Callable[..., Any], *args: Any) -> Any:
            # Some boards do not report utilization or temperature (NotSupported).
            try:
                return fn(*args)
            except pynvml.NVMLError:
                return None

        gpus = []
        for index in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(
                parse_nvml_device(
                    index,
                    name=pynvml.nvmlDeviceGetName(handle),
                    uuid=pynvml.nvmlDeviceGetUUID(handle),
                    memory=pynvml.nvmlDeviceGetMemoryInfo(handle),
                    utilization=optional(pynvml.nvmlDeviceGetUtilizationRates, handle),
                    temperature=optional(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU),
                    capability=optional(pynvml.nvmlDeviceGetCudaComputeCapability, handle),
                    driver_version=driver,
                )
            )
        return gpus
