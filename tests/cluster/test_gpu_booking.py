"""Issue 17 "also look at", on real PostgreSQL: simultaneous loads onto one GPU node, one thread
(and database connection) per load. Each GPU has room for one model: of three loads onto two
GPUs, two are accepted on different GPUs and the third is refused with the numbers. Before the
placement lock the rooms were read outside any lock and two loads booked one GPU in most trials."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.cluster.test_duplicate_names import pg_database  # noqa: F401  (the fixture)
from tests.conftest import REPO
from tests.procs import PYTHON

pytestmark = pytest.mark.cluster

TRIALS = 8
SCRIPT = """
import json, threading
from django.db import connections
from hardware.models import GpuDevice, Node
from hardware.services import register_node
from serving.models import DesiredState, ModelInstance
from serving.control.planning import plan_load
from serving.control.services import LoadRefused, request_load

CUDA = {"name": "llama-server", "available": True, "version": "b6500", "flavour": "cuda",
        "path": "/opt/llama-server", "reason": ""}
node = register_node(name="pg-node", address="127.0.0.1")
Node.objects.filter(pk=node.pk).update(backends=[CUDA], detector="nvml")
for index in (0, 1):
    GpuDevice.objects.create(node=node, index=index, vendor="NVIDIA", type="NVIDIA", name="L4",
                             memory_total_mib=100000, memory_used_mib=0)
need = plan_load(model_path=MODEL, model_name="probe", node="pg-node").estimate.total_mib
GpuDevice.objects.filter(node=node).update(memory_used_mib=100000 - int(need * 1.5))  # room for one each
trials = []
for trial in range(TRIALS):
    barrier = threading.Barrier(3)
    outcomes = []

    def load(i):
        try:
            barrier.wait()
            inst = request_load(model_path=MODEL, model_name=f"m-{trial}-{i}", node="pg-node")
            outcomes.append(f"gpu {inst.gpus}")
        except LoadRefused as exc:
            outcomes.append(f"{exc.status} {exc.code}: {exc}")
        except Exception as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trials.append(sorted(outcomes))
    ModelInstance.objects.filter(model_name__startswith=f"m-{trial}-").update(
        state="STOPPED", desired_state=DesiredState.STOPPED)
print("TRIALS " + json.dumps(trials))
"""


def test_simultaneous_loads_never_book_one_gpu_twice(pg_database, tiny_gguf):  # noqa: F811
    script = f"TRIALS = {TRIALS}\nMODEL = {str(tiny_gguf)!r}\n" + SCRIPT
    out = subprocess.run([PYTHON, str(REPO / "manage.py"), "shell", "-v", "0", "-c", script], env=pg_database,
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    trials = json.loads(out.stdout.split("TRIALS ", 1)[1])
    wrong = [t for t in trials if t[1:] != ["gpu [0]", "gpu [1]"] or not t[0].startswith("409 does_not_fit")]
    assert not wrong, f"{len(wrong)} of {TRIALS} trials went wrong: {wrong}"
    assert "free" in trials[0][0]  # the refusal gives the numbers
