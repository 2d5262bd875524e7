"""Cluster mode: nodes, heartbeats and agents across processes on PostgreSQL and Redis."""
import time

import pytest

from tests.procs import pid_alive

pytestmark = pytest.mark.cluster


def _status(cluster, web: str) -> dict[str, str]:
    with cluster.api(web) as client:
        return {n["name"]: n["status"] for n in client.get("/api/hardware/nodes").json()}


def test_both_web_processes_see_both_nodes(cluster):
    # Read until both say so: with heartbeats every 1 s and XGEN_NODE_STALE_AFTER=3 (the harness),
    # a node whose agent is starved for 3 s on a loaded 2-core machine reads "stale" for a moment
    # (clean CI at f9f5cd2: node-b stale on web b right after web a read it online).
    both = {"node-a": "online", "node-b": "online"}
    for web in ("a", "b"):
        deadline = time.monotonic() + 20
        while (seen := _status(cluster, web)) != both and time.monotonic() < deadline:
            time.sleep(0.3)
        assert seen == both, (web, seen)
    for web in cluster.webs.values():
        import httpx

        ready = httpx.get(f"{web.url}/readyz").json()
        assert ready["status"] == "ready" and set(ready["nodes"]) == {"node-a", "node-b"}


def test_a_second_agent_for_a_node_is_refused(cluster):
    import subprocess

    with pytest.raises(subprocess.CalledProcessError) as err:
        cluster.manage("nodeagent", "--name", "node-a", env=cluster.node_env("node-a"))
    assert "another node agent" in err.value.stderr


def test_a_killed_agent_goes_offline_and_comes_back(cluster):
    pid = cluster.agents["node-b"].proc.pid
    cluster.kill_agent("node-b")
    assert not pid_alive(pid)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _status(cluster, "a")["node-b"] != "offline":
        time.sleep(0.3)
    assert _status(cluster, "a") == {"node-a": "online", "node-b": "offline"}
    cluster.start_agent("node-b")
    cluster.wait_nodes_online({"node-a", "node-b"}, web="b", timeout=30)
