"""How the GPUs page's node cards scale with the cluster: render time for 20 nodes x 8 GPUs
against 1 node x 8 GPUs, measured in the same run on a throwaway SQLite database.

    python bench/hardware_overview.py
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "xgenconsole.settings_test")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from django.utils import timezone  # noqa: E402

from hardware.events import render_gpu_nodes, render_node_update  # noqa: E402
from hardware.models import Node  # noqa: E402
from hardware.services import save_inventory  # noqa: E402
from serving.models import ModelInstance  # noqa: E402
from tests.hardware.conftest import gpu_inventory  # noqa: E402


def add_node(i: int) -> None:
    Node.objects.create(name=f"node-{i:02}", address=f"10.0.0.{i + 1}", last_heartbeat=timezone.now())
    node = save_inventory(node_name=f"node-{i:02}", result=gpu_inventory(*range(8)))
    ModelInstance.objects.create(model_name=f"model-{i}", model_path="gguf/m", backend="vllm", node=node,
                                 gpus=[0, 1, 2, 3], state="READY")


def measure(runs: int = 30) -> tuple[float, int, int]:
    """Median ms to render the cards, queries per render, fragment bytes."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        html = render_gpu_nodes(oob=True)
        times.append((time.perf_counter() - start) * 1000)
    with CaptureQueriesContext(connection) as queries:
        render_gpu_nodes(oob=True)
    return statistics.median(times), len(queries), len(html.encode())


def main() -> None:
    call_command("migrate", verbosity=0)
    add_node(0)
    base_ms, base_q, base_b = measure()
    for i in range(1, 20):
        add_node(i)
    big_ms, big_q, big_b = measure()
    print(f"1 node x 8 GPUs   : {base_ms:6.2f} ms, {base_q} queries, {base_b / 1024:6.1f} KiB")
    print(f"20 nodes x 8 GPUs : {big_ms:6.2f} ms, {big_q} queries, {big_b / 1024:6.1f} KiB")
    print(f"ratio (20 nodes / 1 node): time {big_ms / base_ms:.1f}x, queries {big_q / base_q:.1f}x, "
          f"bytes {big_b / base_b:.1f}x")
    times = []
    for _ in range(30):
        start = time.perf_counter()
        update = render_node_update("node-07")
        times.append((time.perf_counter() - start) * 1000)
    size = sum(len(html.encode()) for _, html in update)
    upd_ms = statistics.median(times)
    print(f"one node's refresh fragments at 20 nodes: {upd_ms:6.2f} ms, {size / 1024:5.1f} KiB "
          f"({upd_ms / big_ms:.2f}x the time, {size / big_b:.2f}x the bytes of the full list)")


if __name__ == "__main__":
    main()
