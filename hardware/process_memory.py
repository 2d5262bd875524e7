"""What a process group really holds: resident memory from /proc on any node, and per-GPU memory
of its pids from NVML (nvmlDeviceGetComputeRunningProcesses) or AMD SMI
(amdsmi_get_gpu_process_list) on a GPU node. Used after a backend is READY (its measured memory)
and after it stops (a pid of the stopped group that still holds GPU memory is a leak)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("xgen.hardware.memory")
MIB = 1024 * 1024
PROC = Path("/proc")


def _state(pid: int) -> str:
    """The process's state letter ("" when it is gone)."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def alive(pid: int) -> bool:
    """Running, not gone and not a zombie (a zombie holds no memory)."""
    return _state(pid) not in ("", "Z")


def group_pids(pgid: int) -> list[int]:
    """Every live (non-zombie) process of the process group."""
    pids = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return sorted(pids)


def rss_mib(pids: list[int]) -> int:
    """Resident memory of the processes together (VmRSS), in MiB."""
    total_kib = 0
    for pid in pids:
        try:
            for line in (PROC / str(pid) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
                    break
        except (OSError, ValueError, IndexError):
            continue
    return round(total_kib / 1024)


def parse_nvml_processes(processes: list[Any]) -> dict[int, int]:
    """pid -> MiB from nvmlDeviceGetComputeRunningProcesses' c_nvmlProcessInfo_t list (usedGpuMemory
    in bytes; None where the driver cannot tell, e.g. some containers: counted as 0)."""
    out: dict[int, int] = {}
    for proc in processes:
        used = getattr(proc, "usedGpuMemory", None)
        out[int(proc.pid)] = out.get(int(proc.pid), 0) + (round(used / MIB) if isinstance(used, int) else 0)
    return out


def parse_amdsmi_processes(processes: list[Any]) -> dict[int, int]:
    """pid -> MiB from amdsmi_get_gpu_process_list (6.x: dicts with memory_usage.vram_mem in bytes)."""
    out: dict[int, int] = {}
    for proc in processes:
        if not isinstance(proc, dict) or "pid" not in proc:
            continue
        usage = proc.get("memory_usage") or {}
        vram = usage.get("vram_mem") if isinstance(usage, dict) else None
        if not isinstance(vram, int):
            mem = proc.get("mem")
            vram = mem if isinstance(mem, int) else 0
        out[int(proc["pid"])] = out.get(int(proc["pid"]), 0) + round(vram / MIB)
    return out


def gpu_memory_by_pid() -> tuple[dict[int, dict[int, int]], str]:
    """GPU index -> {pid: MiB} for every compute process, and the library that told ("" on a node
    where neither NVML nor AMD SMI answers: a CPU node)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return {i: parse_nvml_processes(pynvml.nvmlDeviceGetComputeRunningProcesses(
                pynvml.nvmlDeviceGetHandleByIndex(i))) for i in range(pynvml.nvmlDeviceGetCount())}, "nvml"
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # no driver, no library, NVMLError: try the next
        log.debug("NVML per-process memory unavailable: %s", exc)
    try:
        import amdsmi

        amdsmi.amdsmi_init()
        try:
            handles = amdsmi.amdsmi_get_processor_handles()
            return {i: parse_amdsmi_processes(amdsmi.amdsmi_get_gpu_process_list(h))
                    for i, h in enumerate(handles)}, "amdsmi"
        finally:
            amdsmi.amdsmi_shut_down()
    except Exception as exc:
        log.debug("AMD SMI per-process memory unavailable: %s", exc)
    return {}, ""


@dataclass
class Measured:
    total_mib: int
    source: str  # "nvml", "amdsmi" (GPU memory of the group's pids) or "rss" (resident memory)
    per_gpu: dict[int, int] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)

    @property
    def label(self) -> str:
        where = {"nvml": "GPU memory (NVML)", "amdsmi": "GPU memory (AMD SMI)"}.get(self.source, "resident memory")
        return f"{self.total_mib} MiB of {where}"


def measure_group(pgid: int, gpus: list[int], by_pid: dict[int, dict[int, int]] | None = None,
                  source: str = "") -> Measured | None:
    """What the group holds: on its GPUs when it has some and a library tells per process, else
    its resident memory. None when the group has no process left."""
    pids = group_pids(pgid)
    if not pids:
        return None
    if gpus:
        if by_pid is None:
            by_pid, source = gpu_memory_by_pid()
        if source:
            per_gpu = {g: sum(mib for pid, mib in by_pid.get(g, {}).items() if pid in pids) for g in gpus}
            return Measured(sum(per_gpu.values()), source, per_gpu, pids)
    return Measured(rss_mib(pids), "rss", {}, pids)


def gpu_leaks(pids: list[int], by_pid: dict[int, dict[int, int]]) -> dict[int, dict[int, int]]:
    """pid -> {GPU: MiB} for those of `pids` (a stopped group's) that still hold GPU memory."""
    leaks: dict[int, dict[int, int]] = {}
    for gpu, holders in by_pid.items():
        for pid, mib in holders.items():
            if pid in pids and alive(pid):
                leaks.setdefault(pid, {})[gpu] = mib
    return leaks


__all__ = ["Measured", "alive", "gpu_leaks", "gpu_memory_by_pid", "group_pids", "measure_group", "parse_amdsmi_processes",
           "parse_nvml_processes", "rss_mib"]
