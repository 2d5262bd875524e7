"""Every page's server time with 20 nodes x 8 GPUs, 200 instances and 10,000 events (and an hour of
the dashboard's 10 s samples), as ratios to a baseline measured in the same run: /healthz (the
same middleware, no work) and each page on an empty database. The Django test client renders the
whole response, so the time is an upper bound of the first byte's.

    python bench/pages.py
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ["DATABASE_URL"] = f"sqlite:///{tempfile.mkdtemp(prefix='xgen-bench-pages-')}/bench.sqlite3"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "xgenconsole.settings_test")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.test import Client  # noqa: E402
from django.utils import timezone  # noqa: E402

from accounts.models import ApiKey, User  # noqa: E402
from hardware.dashboard import record_node_sample  # noqa: E402
from hardware.models import Node  # noqa: E402
from hardware.services import save_inventory  # noqa: E402
from history.samples import downsample  # noqa: E402
from serving.models import InstanceEvent, InstanceState, ModelInstance  # noqa: E402
from tests.hardware.conftest import gpu_inventory  # noqa: E402

BUDGET_MS = 50.0
STATES = [InstanceState.READY] * 6 + [InstanceState.STOPPED, InstanceState.ERROR, InstanceState.LOADING]


def pages(admin: User) -> list[str]:
    node = Node.objects.order_by("name").first()
    inst = ModelInstance.objects.order_by("pk").first()
    key = ApiKey.objects.first()
    paths = ["/", "/?range=24h", "/?range=7d", "/instances/", "/instances/new/", "/gpus/", "/models/",
             "/models/upload/", "/downloads/", "/usage/", "/requests/", "/keys/", "/users/", "/audit/",
             f"/users/{admin.pk}/"]
    if node is not None:
        paths += [f"/nodes/{node.name}/", f"/nodes/{node.name}/cache/"]
    if inst is not None:
        paths.append(f"/instances/{inst.pk}/")
    if key is not None:
        paths.append(f"/keys/{key.pk}/")
    return paths


def server_ms(client: Client, paths: list[str], runs: int = 15) -> dict[str, float]:
    """Median server time of each page, the pages taken in turn (round robin), so that a burst of
    noise on this shared machine spreads over every page instead of landing on one."""
    times: dict[str, list[float]] = {p: [] for p in paths}
    for path in paths:  # warm: templates compiled, caches filled
        assert client.get(path).status_code == 200, path
    for _ in range(runs):
        for path in paths:
            start = time.perf_counter()
            response = client.get(path)
            times[path].append((time.perf_counter() - start) * 1000)
            assert response.status_code == 200, (path, response.status_code)
    return {p: statistics.median(t) for p, t in times.items()}


def fill() -> None:
    rng = random.Random(3)
    admin = User.objects.get(username="bench")
    ApiKey.objects.create(user=admin, name="bench", prefix="xg-bench", key_hash="0" * 64)
    now = time.time()
    for i in range(20):
        Node.objects.create(name=f"node-{i:02}", address=f"10.0.0.{i + 1}", last_heartbeat=timezone.now())
        save_inventory(node_name=f"node-{i:02}", result=gpu_inventory(*range(8)))
    nodes = list(Node.objects.all())
    instances = []
    for i in range(200):
        state = STATES[i % len(STATES)]
        node = nodes[i % len(nodes)]
        gpus = [(i // len(nodes)) % 8] if state != InstanceState.STOPPED else []
        instances.append(ModelInstance(model_name=f"model-{i}", model_path=f"gguf/model-{i}", backend="vllm",
                                       node=node, gpus=gpus, state=state, estimated_memory_mib=20000,
                                       last_error="CUDA out of memory" if state == InstanceState.ERROR else ""))
    ModelInstance.objects.bulk_create(instances)
    instances = list(ModelInstance.objects.all())
    start = timezone.now() - timedelta(days=7)
    events = [InstanceEvent(instance=instances[rng.randrange(len(instances))], at=start + timedelta(seconds=60 * k),
                            from_state="LOADING", to_state="READY", message=f"event {k}") for k in range(10_000)]
    InstanceEvent.objects.bulk_create(events, batch_size=2000)
    for node in nodes:  # an hour of the dashboard's 10 s samples, rolled up as the agents' job does
        for k in range(360):
            record_node_sample(node.name, at=now - 3600 + k * 10)
    downsample(now=now)


def main() -> None:
    call_command("migrate", verbosity=0)
    admin = User.objects.create_user("bench", password="x" * 12, role="admin")
    client = Client(HTTP_HOST="localhost")
    client.force_login(admin)
    healthz = server_ms(client, ["/healthz"], runs=31)["/healthz"]
    empty = server_ms(client, pages(admin))
    t = time.perf_counter()
    fill()
    print(f"filled 20 nodes x 8 GPUs, 200 instances, 10,000 events, 1 h of samples in {time.perf_counter() - t:.0f} s")
    print(f"baseline /healthz: {healthz:.2f} ms")
    print(f"{'page':32} {'ms':>7} {'x healthz':>10} {'x empty db':>11}  under {BUDGET_MS:.0f} ms")
    worst = 0.0
    for path, ms in server_ms(client, pages(admin)).items():
        worst = max(worst, ms)
        base = empty.get(path)
        ratio = f"{ms / base:10.1f}x" if base else f"{'(new)':>11}"
        print(f"{path:32} {ms:7.1f} {ms / healthz:9.1f}x {ratio}  {'yes' if ms < BUDGET_MS else 'NO'}")
    print(f"slowest page: {worst:.1f} ms = {worst / healthz:.1f}x /healthz")


if __name__ == "__main__":
    main()
