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


class CpuDetector(Detector):
    name = "cpu"
    label = "cpu"

    def detect(self) -> list[DetectedGpu]:
        return []
