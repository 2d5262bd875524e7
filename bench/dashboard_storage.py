"""What a year of the dashboard's history costs, and what the dashboard costs to render with it.

20 nodes x 8 GPUs (200 series: each GPU, each node's GPUs together and its RAM/CPU) and 10 models, sampled for a
year: the rows the retention keeps (10 s for a day, 5 min for 30 days, 1 h for a year) plus an
hour past each retention and two hours not yet rolled up, then the real downsampling job
(history.samples.downsample) rolls up and prunes. Sizes are read from the real tables on SQLite
(dbstat: table and index pages). Render times are the dashboard view's server time, as ratios
to an empty database's render in the same run.

    python bench/dashboard_storage.py
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
_tmp = tempfile.mkdtemp(prefix="xgen-bench-dash-")
os.environ["DATABASE_URL"] = f"sqlite:///{_tmp}/bench.sqlite3"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "xgenconsole.settings_test")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.test import Client  # noqa: E402
from django.utils import timezone  # noqa: E402

from accounts.models import User  # noqa: E402
from hardware.models import Node  # noqa: E402
from hardware.services import save_inventory  # noqa: E402
from history.models import ModelSample, ResourceSample  # noqa: E402
from history.samples import LATENCY_BOUNDS_MS, RETENTION_S, downsample  # noqa: E402
from tests.hardware.conftest import gpu_inventory  # noqa: E402

NODES, GPUS, MODELS = 20, 8, 10
STATED_MAX_MIB = 512  # the bound this bench shows for a year of 20 nodes x 8 GPUs (+ 10 models)
UNROLLED_S = 2 * 3600  # the newest two hours exist only as 10 s rows: the job rolls them up


def fill(now: int) -> int:
    rng = random.Random(7)
    table = ResourceSample._meta.db_table
    sql = (f"INSERT INTO {table} (step, at, node, gpu, mem_used_mib, mem_total_mib, mem_alloc_mib, util_pct) "
           "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)")
    total = 0
    for step, keep in RETENTION_S.items():
        end = now // step * step - (0 if step == 10 else UNROLLED_S)
        start = (now - keep - 3600) // step * step
        with transaction.atomic(), connection.cursor() as cur:
            rows = []
            for at in range(start, end, step):
                for n in range(NODES):
                    node = f"node-{n:02}"
                    rows.append((step, at, node, -1, 200000 + rng.randrange(9000), 515000, 0, rng.random() * 100))
                    rows.append((step, at, node, -2, GPUS * 70000, GPUS * 81559, GPUS * 40000, rng.random() * 100))
                    for g in range(GPUS):
                        rows.append((step, at, node, g, 60000 + rng.randrange(20000), 81559, 40000,
                                     rng.random() * 100))
                if len(rows) > 50000:
                    cur.executemany(sql, rows)
                    total += len(rows)
                    rows = []
            cur.executemany(sql, rows)
            total += len(rows)
        batch = []
        for at in range(start, end, step):
            for m in range(MODELS):
                hist = [rng.randrange(50) for _ in range(len(LATENCY_BOUNDS_MS) + 1)]
                batch.append(ModelSample(step=step, at=at, model=f"model-{m}", requests=sum(hist), errors=hist[-1],
                                         prompt_tokens=sum(hist) * 40, completion_tokens=sum(hist) * 90,
                                         latency_hist=hist, ttft_hist=hist))
        ModelSample.objects.bulk_create(batch, batch_size=5000)
        total += len(batch)
    return total


def sizes() -> dict[str, int]:
    """Bytes of each history table with its indexes (dbstat), after VACUUM."""
    with connection.cursor() as cur:
        cur.execute("VACUUM")
        out = {}
        for model in (ResourceSample, ModelSample):
            table = model._meta.db_table
            cur.execute("SELECT SUM(pgsize) FROM dbstat WHERE name = %s OR name IN "
                        "(SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = %s)", [table, table])
            out[table] = cur.fetchone()[0] or 0
        return out


def render_ms(client: Client, query: str, runs: int = 15) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        response = client.get("/" + query)
        times.append((time.perf_counter() - start) * 1000)
        assert response.status_code == 200
    return statistics.median(times)


def main() -> None:
    call_command("migrate", verbosity=0)
    user = User.objects.create_user("bench", password="x" * 12, role="viewer")
    client = Client(HTTP_HOST="localhost")
    client.force_login(user)
    base = render_ms(client, "")
    print(f"baseline: the dashboard on an empty database: {base:.1f} ms")
    for i in range(NODES):
        Node.objects.create(name=f"node-{i:02}", address=f"10.0.0.{i + 1}", last_heartbeat=timezone.now())
        save_inventory(node_name=f"node-{i:02}", result=gpu_inventory(*range(GPUS)))
    no_history = {r: render_ms(client, f"?range={r}") for r in ("1h", "24h", "7d")}
    now = int(time.time())
    t = time.perf_counter()
    inserted = fill(now)
    print(f"inserted {inserted:,} rows (a year as kept, an hour past each retention, two hours unrolled) "
          f"in {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    done = downsample(now=now)
    print(f"downsample job: rolled {done['rolled']:,} rows, pruned {done['pruned']:,} in {time.perf_counter() - t:.1f} s")
    for model in (ResourceSample, ModelSample):
        counts = {step: model.objects.filter(step=step).count() for step in RETENTION_S}
        print(f"  {model._meta.db_table}: " + ", ".join(f"{step} s: {n:,}" for step, n in counts.items()))
    size = sizes()
    total = sum(size.values())
    for table, b in size.items():
        print(f"  {table}: {b / 2**20:.1f} MiB (table + indexes)")
    verdict = "under" if total < STATED_MAX_MIB * 2**20 else "OVER"
    print(f"a year of history for {NODES} nodes x {GPUS} GPUs + {MODELS} models: {total / 2**20:.1f} MiB, "
          f"{verdict} the stated {STATED_MAX_MIB} MiB")
    for r in ("1h", "24h", "7d"):
        ms = render_ms(client, f"?range={r}")
        print(f"dashboard, range {r:>3}: {ms:6.1f} ms server time = {ms / base:4.1f}x the empty render, "
              f"{ms / no_history[r]:4.1f}x the same fleet without history ({no_history[r]:.1f} ms)")


if __name__ == "__main__":
    main()
