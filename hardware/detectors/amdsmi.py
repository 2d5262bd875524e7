"""AMD GPUs through AMD SMI (the `amdsmi` Python package from ROCm)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hardware.detectors.base import DetectedGpu, Detector, amd_gpu_type, as_text


def _number(value: Any) -> float | None:
    """amdsmi reports "N/A" (or None) for metrics a board does not expose."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def parse_amdsmi_device(
    index: int,
    *,
    asic: dict[str, Any],
    vram: dict[str, Any],
    activity: dict[str, Any] | None,
    temperature: Any,
    uuid: Any,
    driver: dict[str, Any] | None,
) -> DetectedGpu:
    """Turn amdsmi's dicts for one GPU into a DetectedGpu.

    asic: amdsmi_get_gpu_asic_info (market_name, vendor_name, target_graphics_version "gfx942");
    vram: amdsmi_get_gpu_vram_usage (vram_total / vram_used in MB); activity:
    amdsmi_get_gpu_activity (gfx_activity %); temperature: amdsmi_get_temp_metric (°C);
    driver: amdsmi_get_gpu_driver_info (driver_version).
    """
    gfx = as_text(asic.get("target_graphics_version")).strip().lower()
    if gfx and not gfx.startswith("gfx"):
        gfx = f"gfx{gfx}"
    vendor = as_text(asic.get("vendor_name")) or "AMD"
    if "advanced micro devices" in vendor.lower() or vendor.upper().startswith("AMD"):
        vendor = "AMD"
    return DetectedGpu(
        index=index,
        uuid=as_text(uuid),
        vendor=vendor,
        type=amd_gpu_type(gfx),
        name=as_text(asic.get("market_name")) or gfx or "AMD GPU",
        arch=gfx,
        driver_version=as_text((driver or {}).get("driver_version")),
        memory_total_mib=int(_number(vram.get("vram_total")) or 0),
        memory_used_mib=int(_number(vram.get("vram_used")) or 0),
        utilization_pct=_number((activity or {}).get("gfx_activity")),
        temperature_c=_number(temperature),
    )


class AmdSmiDetector(Detector):
    name = "amdsmi"
    label = "amdsmi"

    def detect(self) -> list[DetectedGpu]:
        try:
            import amdsmi
        except ImportError:
            raise self.unavailable("amdsmi not installed") from None
        except KeyError as exc:
            # amdsmi raises KeyError('libamd_smi.so') at import when ROCm's library is absent.
            raise self.unavailable(f"{exc.args[0] if exc.args else 'libamd_smi.so'} not found") from None
        except OSError as exc:
            raise self.unavailable(f"cannot load the library: {exc}") from None
        try:
            amdsmi.amdsmi_init()
        except Exception as exc:  # AmdSmiLibraryException and friends: the driver is not there
            raise self.unavailable(f"init failed: {exc}") from None
        try:
            return self._read_all(amdsmi)
        except Exception as exc:
            raise self.unavailable(f"query failed: {exc}") from None
        finally:
            try:
                amdsmi.amdsmi_shut_down()
            except Exception:
                pass

    def _read_all(self, amdsmi: Any) -> list[DetectedGpu]:
        handles = amdsmi.amdsmi_get_processor_handles()
        if not handles:
            raise self.unavailable("no AMD GPUs")

        def optional(fn: Callable[..., Any], *args: Any) -> Any:
            try:
                return fn(*args)
            except Exception:
                return None

        gpus = []
        for index, handle in enumerate(handles):
            gpus.append(
                parse_amdsmi_device(
                    index,
                    asic=amdsmi.amdsmi_get_gpu_asic_info(handle),
                    vram=amdsmi.amdsmi_get_gpu_vram_usage(handle),
                    activity=optional(amdsmi.amdsmi_get_gpu_activity, handle),
                    temperature=self._temperature(amdsmi, handle),
                    uuid=optional(amdsmi.amdsmi_get_gpu_device_uuid, handle),
                    driver=optional(amdsmi.amdsmi_get_gpu_driver_info, handle),
                )
            )
        return gpus

    @staticmethod
    def _temperature(amdsmi: Any, handle: Any) -> Any:
        """Hotspot (junction) temperature; edge where hotspot is not reported. MI300 has no edge sensor."""
        for sensor in (amdsmi.AmdSmiTemperatureType.HOTSPOT, amdsmi.AmdSmiTemperatureType.EDGE):
            try:
                return amdsmi.amdsmi_get_temp_metric(handle, sensor, amdsmi.AmdSmiTemperatureMetric.CURRENT)
            except Exception:
                continue
        return None
