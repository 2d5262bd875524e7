"""The last detector: always succeeds with no GPUs; also reads cores and memory for every node."""
from __future__ import annotations

import os
from pathlib import Path

from hardware.detectors.base import CpuInfo, DetectedGpu, Detector


def parse_meminfo(text: str) -> tuple[int, int]:
    """(total MiB, used MiB) from /proc/meminfo text; used = MemTotal - MemAvailable."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0])  # kB
    total_kb = values.get("MemTotal", 0)
    available_kb = values.get("MemAvailable", values.get("MemFree", 0))
    return total_kb // 1024, max(0, total_kb - available_kb) // 1024


def read_cpu_info(meminfo: Path = Path("/proc/meminfo")) -> CpuInfo:
    """Cores usable by this process and system memory."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        total, used = parse_meminfo(meminfo.read_text())
    except OSError:
        # No procfs: total from sysconf, used unknown.
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
        used = 0
    return CpuInfo(cores=cores, memory_total_mib=total, memory_used_mib=used)


def parse_proc_stat(text: str) -> tuple[int, int]:
    """(busy, total) jiffies from the aggregate `cpu` line of /proc/stat (idle + iowait are not busy)."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
            idle = values[3] + (values[4] if len(values) > 4 else 0)
            total = sum(values)
            return total - idle, total
    return 0, 0


def read_cpu_times(stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(busy, total) jiffies since boot; None without procfs."""
    try:
        return parse_proc_stat(stat.read_text())
    except (OSError, ValueError):
        return None


def cpu_percent(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """CPU use between two read_cpu_times() samples, in %; None when it cannot be told."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round(100.0 * (after[0] - before[0]) / (after[1] - before[1]), 1)


class CpuDetector(Detector):
    name = "cpu"
    label = "cpu"

    def detect(self) -> list[DetectedGpu]:
        return []
