"""Issue 17 #4 on real PostgreSQL: simultaneous loads of one served name, one process with a
thread (and a database connection) per load. Before the constraint, an empty SELECT ... FOR
UPDATE locked nothing and two or three of three were accepted in most trials."""
from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest

from tests.cluster.harness import PG_ADMIN_DSN, _pg_admin, services_available
from tests.conftest import REPO
from tests.procs import PYTHON
from tests.serving.conftest import LLAMA_CPP_PYTHON

pytestmark = pytest.mark.cluster

TRIALS = 10
LOADS = 3
SCRIPT = """
import json, threading
from django.db import connections
from hardware.models import Node
from hardware.services import register_node
from serving.control.services import LoadRefused, request_load

node = register_node(name="pg-node", address="127.0.0.1")
Node.objects.filter(pk=node.pk).update(backends=json.loads(BACKENDS))
trials = []
for trial in range(TRIALS):
    barrier = threading.Barrier(LOADS)
    outcomes = []

    def load():
        try:
            barrier.wait()
            request_load(model_path=MODEL, model_name=f"dup-{trial}")
            outcomes.append("accepted")
        except LoadRefused as exc:
            outcomes.append(f"{exc.status} {exc.code}")
        except Exception as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=load) for _ in range(LOADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    from serving.models import ModelInstance
    trials.append({"outcomes": sorted(outcomes), "rows": ModelInstance.objects.filter(model_name=f"dup-{trial}").count()})
print("TRIALS " + json.dumps(trials))
"""


@pytest.fixture
def pg_database(tmp_path):
    missing = services_available()
    if missing:
        pytest.fail(f"needs PostgreSQL and Redis on loopback (.ci/run starts them): {missing}")
    database = f"xgen_dup_{uuid.uuid4().hex[:10]}"
    _pg_admin(f'CREATE DATABASE "{database}"')
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "xgenconsole.settings",
           "DATABASE_URL": f"{PG_ADMIN_DSN.rsplit('/', 1)[0]}/{database}", "XGEN_DATA_DIR": str(tmp_path / "data"),
           "XGEN_NODE_NAME": "pg-node", "XGEN_DEMO_MODEL": "false"}
    env.pop("REDIS_URL", None)
    try:
        subprocess.run([PYTHON, str(REPO / "manage.py"), "migrate", "-v0"], env=env, cwd=REPO, check=True,
                       capture_output=True, timeout=120)
        yield env
    finally:
        _pg_admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def test_simultaneous_loads_of_one_name_accept_exactly_one(pg_database, tiny_gguf):
    script = (f"TRIALS = {TRIALS}\nLOADS = {LOADS}\nMODEL = {str(tiny_gguf)!r}\n"
              f"BACKENDS = {json.dumps([LLAMA_CPP_PYTHON])!r}\n" + SCRIPT)
    out = subprocess.run([PYTHON, str(REPO / "manage.py"), "shell", "-v", "0", "-c", script], env=pg_database,
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    trials = json.loads(out.stdout.split("TRIALS ", 1)[1])
    expected = ["409 duplicate_model_name"] * (LOADS - 1) + ["accepted"]
    wrong = [t for t in trials if t["outcomes"] != expected or t["rows"] != 1]
    assert not wrong, f"{len(wrong)} of {TRIALS} trials went wrong: {wrong}"
