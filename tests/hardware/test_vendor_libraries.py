"""AmdSmiDetector against stand-in `amdsmi` packages (the real one needs ROCm), and the layering rule."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from hardware.detectors.amdsmi import AmdSmiDetector
from hardware.detectors.base import DetectorUnavailable
from hardware.detectors.cpu import cpu_percent, parse_proc_stat
from hardware.detectors.nvml import NvmlDetector
from tests.hardware import recorded

REPO = Path(__file__).resolve().parents[2]

# What amdsmi's own __init__ does on a machine without ROCm: print, then KeyError('libamd_smi.so').
BROKEN_AMDSMI = """print("Unable to find amdsmi library try installing amd-smi-lib from your package manager")
raise KeyError("libamd_smi.so")
"""

# A two-GPU node (MI300X + RX 7900 XTX) answering with the recorded dicts, through amdsmi's API names.
WORKING_AMDSMI = f"""
import enum
RECORDED = [{recorded.AMDSMI_MI300X!r}, {recorded.AMDSMI_RX7900XTX!r}]
class AmdSmiTemperatureType(enum.IntEnum):
    EDGE = 0
    HOTSPOT = 1
class AmdSmiTemperatureMetric(enum.IntEnum):
    CURRENT = 0
class AmdSmiLibraryException(Exception):
    pass
calls = []
def amdsmi_init(flags=None): calls.append("init")
def amdsmi_shut_down(): calls.append("shut_down")
def amdsmi_get_processor_handles(): return [0, 1]
def amdsmi_get_gpu_asic_info(h): return RECORDED[h]["asic"]
def amdsmi_get_gpu_vram_usage(h): return RECORDED[h]["vram"]
def amdsmi_get_gpu_activity(h): return RECORDED[h]["activity"]
def amdsmi_get_gpu_device_uuid(h): return RECORDED[h]["uuid"]
def amdsmi_get_gpu_driver_info(h): return RECORDED[h]["driver"]
def amdsmi_get_temp_metric(h, sensor, metric):
    assert sensor == AmdSmiTemperatureType.HOTSPOT and metric == AmdSmiTemperatureMetric.CURRENT
    value = RECORDED[h]["temperature"]
    if value == "N/A":
        raise AmdSmiLibraryException("AMDSMI_STATUS_NOT_SUPPORTED")
    return value
"""

NO_DRIVER_AMDSMI = """
class AmdSmiLibraryException(Exception):
    pass
def amdsmi_init(flags=None):
    raise AmdSmiLibraryException("Error code:\\n\\t34 | AMDSMI_STATUS_DRIVER_NOT_LOADED - Driver not loaded")
def amdsmi_shut_down(): pass
"""


@pytest.fixture
def amdsmi_package(tmp_path, monkeypatch):
    def install(source: str) -> None:
        (tmp_path / "amdsmi").mkdir()
        (tmp_path / "amdsmi" / "__init__.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))

    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    yield install
    sys.modules.pop("amdsmi", None)


def test_amdsmi_that_cannot_find_its_library_does_not_apply(amdsmi_package, capsys):
    amdsmi_package(BROKEN_AMDSMI)
    with pytest.raises(DetectorUnavailable) as info:
        AmdSmiDetector().detect()
    assert str(info.value) == "amdsmi: libamd_smi.so not found"


def test_amdsmi_without_a_driver_does_not_apply(amdsmi_package):
    amdsmi_package(NO_DRIVER_AMDSMI)
    with pytest.raises(DetectorUnavailable) as info:
        AmdSmiDetector().detect()
    assert str(info.value).startswith("amdsmi: init failed: Error code:")
    assert "DRIVER_NOT_LOADED" in str(info.value)


def test_amdsmi_reads_every_gpu_and_shuts_down(amdsmi_package):
    amdsmi_package(WORKING_AMDSMI)
    gpus = AmdSmiDetector().detect()
    assert [(g.index, g.name, g.type, g.arch, g.temperature_c) for g in gpus] == [
        (0, "AMD Instinct MI300X", "AMD_CDNA", "gfx942", 38.0),
        (1, "Radeon RX 7900 XTX", "AMD_RDNA", "gfx1100", None),
    ]
    assert sys.modules["amdsmi"].calls == ["init", "shut_down"]


def test_cpu_use_from_proc_stat():
    before = parse_proc_stat("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n")
    after = parse_proc_stat("cpu  160 0 70 900 70 0 0 0 0 0\n")
    assert before == (150, 1000) and after == (230, 1200)
    assert cpu_percent(before, after) == 40.0
    assert cpu_percent(after, after) is None and cpu_percent(None, after) is None


def test_hardware_never_imports_serving_or_hub_at_module_level():
    offenders = []
    for path in (REPO / "hardware").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only: lazy imports inside functions are allowed
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in ("serving", "hub")]
    assert offenders == []


# nvidia-ml-py's API on a two-GPU H100/H200 node; the H200 reports no utilization or temperature.
STANDIN_PYNVML = """
from types import SimpleNamespace
NVML_TEMPERATURE_GPU = 0
class NVMLError(Exception):
    pass
class NVMLError_NotSupported(NVMLError):
    pass
RECORDED = [
    dict(name="NVIDIA H100 80GB HBM3", uuid="GPU-aaa", total=85520809984, used=569901056, util=37, temp=41, cc=(9, 0)),
    dict(name="NVIDIA H200", uuid="GPU-bbb", total=150754820096, used=533659648, util=None, temp=None, cc=(9, 0)),
]
calls = []
def nvmlInit(): calls.append("init")
def nvmlShutdown(): calls.append("shutdown")
def nvmlDeviceGetCount(): return len(RECORDED)
def nvmlDeviceGetHandleByIndex(i): return RECORDED[i]
def nvmlSystemGetDriverVersion(): return "560.35.03"
def nvmlDeviceGetName(h): return h["name"]
def nvmlDeviceGetUUID(h): return h["uuid"]
def nvmlDeviceGetMemoryInfo(h): return SimpleNamespace(total=h["total"], used=h["used"], free=h["total"] - h["used"])
def nvmlDeviceGetCudaComputeCapability(h): return h["cc"]
def nvmlDeviceGetUtilizationRates(h):
    if h["util"] is None:
        raise NVMLError_NotSupported("Not Supported")
    return SimpleNamespace(gpu=h["util"], memory=3)
def nvmlDeviceGetTemperature(h, sensor):
    assert sensor == NVML_TEMPERATURE_GPU
    if h["temp"] is None:
        raise NVMLError_NotSupported("Not Supported")
    return h["temp"]
"""


def test_nvml_reads_every_gpu_and_tolerates_unsupported_metrics(tmp_path, monkeypatch):
    (tmp_path / "pynvml.py").write_text(STANDIN_PYNVML)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    try:
        gpus = NvmlDetector().detect()
        assert sys.modules["pynvml"].calls == ["init", "shutdown"]
    finally:
        sys.modules.pop("pynvml", None)  # the real pynvml is imported again by later tests
    assert [(g.index, g.name, g.arch, g.memory_total_mib, g.utilization_pct, g.temperature_c, g.driver_version)
            for g in gpus] == [
        (0, "NVIDIA H100 80GB HBM3", "9.0", 81559, 37.0, 41.0, "560.35.03"),
        (1, "NVIDIA H200", "9.0", 143771, None, None, "560.35.03"),
    ]
