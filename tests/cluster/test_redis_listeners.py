"""Channel-layer listeners hold on Redis with nothing to hear (issue 35 #3).

One node agent and one web process on a real Redis, idle for LISTEN_S. A receive is a 5 s
blocking pop on its socket; with redis-py's default socket timeout (also 5 s) it failed as
"Timeout reading from ..." every ~20 s (7a3a6ad: the agent's nudge listener logged "nudges: the
channel layer failed" 3 times in 75 s; the web process's group listeners failed alike, logged
only at debug level). No listener in either process may fail now (the web process's failures
are warnings since this fix, so its log shows them), and a nudge still wakes the agent at once:
its reconcile interval is set far longer than the wait allowed.

LISTEN_S (XGEN_TEST_REDIS_LISTEN_S) defaults to 45 s, where the old code failed twice (once
every ~20 s; 75 s until CI's run passed 45 minutes): the issue asks for 5 minutes (300).
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator

import pytest

from tests.cluster.harness import Cluster, create_cluster, destroy_cluster, services_available

pytestmark = pytest.mark.cluster

LISTEN_S = float(os.environ.get("XGEN_TEST_REDIS_LISTEN_S", "45"))
RECONCILE_S = 300  # the agent's own polling: a load picked up sooner came by its nudge
FAILURES = re.compile(r"Timeout reading|channel layer failed|membership failed")


@pytest.fixture(scope="module")
def idle_cluster(tmp_path_factory, s3_server) -> Iterator[Cluster]:
    missing = services_available()
    if missing:
        pytest.fail(f"cluster tests need PostgreSQL and Redis on loopback (.ci/run starts them): {missing}")
    s3_server.reset()
    c = create_cluster(tmp_path_factory.mktemp("redis-listen"), s3_endpoint=s3_server.endpoint,
                       s3_access=s3_server.access_key, s3_secret=s3_server.secret_key,
                       extra_env={"XGEN_RECONCILE_INTERVAL": str(RECONCILE_S), "XGEN_COLD_START_TIMEOUT_S": "120"})
    try:
        c.start_agent("node-1")
        c.start_web("w")
        c.wait_nodes_online({"node-1"}, web="w")
        yield c
    finally:
        destroy_cluster(c)


@pytest.mark.timeout(LISTEN_S + 240)  # the suite's 300 s would cut a 5-minute run
def test_listeners_hold_and_a_nudge_arrives(idle_cluster, tiny_gguf):
    cluster = idle_cluster
    cluster.manage("hub_upload", str(tiny_gguf), "--format", "gguf", "--name", "tiny-nudge")
    started = time.monotonic()
    time.sleep(LISTEN_S)
    failures = {name: [line for line in proc.log.splitlines() if FAILURES.search(line)]
                for name, proc in (*cluster.agents.items(), *cluster.webs.items())}
    print(f"\nlistener failures in {time.monotonic() - started:.0f} s of an idle cluster: "
          f"{ {name: len(lines) for name, lines in failures.items()} }")
    for name, lines in failures.items():
        assert not lines, f"{name}: {len(lines)} listener failures, the first: {lines[0][:300]}"

    # The agent's nudge listener still hears: a load is picked up long before its reconcile would.
    with cluster.api("w") as client:
        asked = time.monotonic()
        r = client.post("/api/management/load", json={"model_path": "gguf/tiny-nudge", "model_name": "tiny-nudge",
                                                      "node": "node-1"})
        assert r.status_code == 202, r.text
        iid = r.json()["id"]
        state = "PENDING"
        while state == "PENDING" and time.monotonic() - asked < RECONCILE_S / 10:
            time.sleep(0.1)
            state = client.get(f"/api/management/instances/{iid}").json()["state"]
    picked_up = time.monotonic() - asked
    print(f"the load was picked up by the agent ({state}) {picked_up:.1f} s after it was asked for")
    assert state != "PENDING", f"the agent did not pick the load up in {RECONCILE_S / 10:.0f} s: no nudge arrived"
