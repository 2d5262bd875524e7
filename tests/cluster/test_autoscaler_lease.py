"""Issue 30 #2 on PostgreSQL with two web processes: one decision loop for the cluster. Both web
processes run the autoscaler's loop; exactly one holds the lease row at a time, and when it is
killed the other takes the lease over once it expired (ControllerLease, LEASE_TTL_S)."""
from __future__ import annotations

import json
import signal
import time

import pytest

from tests.cluster.harness import Cluster, create_cluster, destroy_cluster, services_available

pytestmark = pytest.mark.cluster

LEASE = ("import json; from serving.models import ControllerLease as L; "
         "print(json.dumps(list(L.objects.values_list('name', 'holder'))))")


@pytest.fixture(scope="module")
def webs(tmp_path_factory, s3_server):
    missing = services_available()
    if missing:
        pytest.fail(f"cluster tests need PostgreSQL and Redis on loopback (.ci/run starts them): {missing}")
    c: Cluster = create_cluster(tmp_path_factory.mktemp("lease"), s3_endpoint=s3_server.endpoint,
                                s3_access=s3_server.access_key, s3_secret=s3_server.secret_key)
    try:
        c.start_web("a")
        c.start_web("b")
        yield c
    finally:
        destroy_cluster(c)


def _holders(c: Cluster) -> list[list[str]]:
    return json.loads(c.manage("shell", "-v", "0", "-c", LEASE).stdout.strip().splitlines()[-1])


def test_one_web_process_holds_the_autoscaler_lease_and_the_other_takes_over(webs):
    c = webs
    pids = {name: str(web.proc.pid) for name, web in c.webs.items()}
    deadline = time.monotonic() + 30
    while not (rows := _holders(c)):
        assert time.monotonic() < deadline, "no web process took the lease"
        time.sleep(0.5)
    assert len(rows) == 1 and rows[0][0] == "autoscaler", rows
    holder = next(name for name, pid in pids.items() if rows[0][1].endswith(f":{pid}"))
    other = "b" if holder == "a" else "a"
    time.sleep(3)
    assert _holders(c)[0][1].endswith(f":{pids[holder]}"), "the holder renews it; the other never takes it"
    killed = c.webs.pop(holder)
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait()
    began = time.monotonic()
    while not _holders(c)[0][1].endswith(f":{pids[other]}"):
        assert time.monotonic() - began < 30, _holders(c)
        time.sleep(0.5)
    took_s = time.monotonic() - began
    assert took_s <= 10 + 5, took_s  # LEASE_TTL_S, then one tick
    print(f"\nweb {holder} killed: web {other} held the lease {took_s:.1f} s later")
