"""Cluster mode, one node name and two agents (issue 35 #2): a second `nodeagent --name node1`
with a data dir of its own (its own file lock) is refused while node1's agent beats heartbeats,
and leaves node1's models alone; an agent whose node was taken stops without touching them; a
clean stop frees the node for the next agent at once. XGEN_NODE_STALE_AFTER is 30 s here, so
no step below can pass by waiting for a heartbeat to age."""
from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.cluster.harness import Cluster, Proc, create_cluster, destroy_cluster, services_available
from tests.procs import pid_alive, stop_process
from tests.serving.conftest import backend_pids

pytestmark = pytest.mark.cluster

NODE = "node1"
MODEL = "tiny-second-agent"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, s3_server) -> Iterator[Cluster]:
    """PostgreSQL + Redis + S3; one agent for node1 and one web process (w)."""
    missing = services_available()
    if missing:
        pytest.fail(f"cluster tests need PostgreSQL and Redis on loopback (.ci/run starts them): {missing}")
    s3_server.reset()
    c = create_cluster(tmp_path_factory.mktemp("second-agent"), s3_endpoint=s3_server.endpoint,
                       s3_access=s3_server.access_key, s3_secret=s3_server.secret_key,
                       extra_env={"XGEN_NODE_STALE_AFTER": "30", "XGEN_NODE_OFFLINE_AFTER": "60"})
    try:
        c.start_agent(NODE)
        c.start_web("w")
        c.wait_nodes_online({NODE}, web="w")
        yield c
    finally:
        destroy_cluster(c)


def _node_row(cluster: Cluster) -> dict:
    code = ("import json; from hardware.models import Node; n = Node.objects.get(name='node1'); "
            "print(json.dumps({'pid': n.agent_pid, 'agent_id': n.agent_id}))")
    return json.loads(cluster.manage("shell", "-v", "0", "-c", code).stdout)


def _events(cluster: Cluster, iid: int) -> list[dict]:
    code = ("import json; from serving.models import InstanceEvent; print(json.dumps(list("
            f"InstanceEvent.objects.filter(instance_id={iid}).order_by('at', 'pk')"
            ".values('from_state', 'to_state', 'message'))))")
    return json.loads(cluster.manage("shell", "-v", "0", "-c", code).stdout.splitlines()[-1])


def _wait(client: httpx.Client, iid: int, states: set[str], timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        body = client.get(f"/api/management/instances/{iid}").json()
        if body["state"] in states:
            return body
        time.sleep(0.2)
    raise AssertionError(f"instance {iid} stayed {body.get('state')}: {body.get('state_message')}")


def _agent(cluster: Cluster, label: str) -> Proc:
    """Another `nodeagent --name node1`, with a data dir (and so a lock) of its own."""
    env = {**cluster.node_env(label), "XGEN_NODE_NAME": NODE}
    return cluster._spawn(f"agent-{label}", ["nodeagent", "--name", NODE], env)


def _exit_code(agent: Proc, timeout: float) -> int | None:
    """The agent's exit code if it exits within `timeout`; else it is stopped cleanly (SIGTERM,
    as systemd would) and None is returned."""
    try:
        return agent.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_process(agent.proc, timeout=40)
        return None


@pytest.fixture(scope="module")
def ready_model(one_node, tiny_gguf) -> dict:
    """The tiny model loaded on node1 by its agent, READY, not autostart (a clean stop of the agent
    that runs it leaves it STOPPED)."""
    code = ("from pathlib import Path; from hub.store import get_store; "
            f"get_store().upload_model('gguf/tiny-second-agent', Path({str(tiny_gguf)!r}))")
    one_node.manage("shell", "-v", "0", "-c", code)
    with one_node.api("w") as w:
        r = w.post("/api/management/load", json={"model_path": "gguf/tiny-second-agent", "node": NODE,
                                                  "model_name": MODEL})
        assert r.status_code == 202, r.text
        inst = _wait(w, r.json()["id"], {"READY", "ERROR"})
    assert inst["state"] == "READY", inst
    return inst


def test_a_second_agent_of_a_live_node_is_refused_and_leaves_its_models_alone(one_node, ready_model):
    first = one_node.agents[NODE]
    iid, pid, port = ready_model["id"], ready_model["pid"], ready_model["port"]
    second = _agent(one_node, "node1-dup")
    code = _exit_code(second, timeout=60)
    log = second.log
    assert code == 1, f"the second agent was not refused (exit {code}):\n{log[-3000:]}"
    assert "held by another node agent" in log and f"pid {first.proc.pid}" in log, log[-3000:]
    assert "XGEN_NODE_STALE_AFTER" in log and "registered" not in log, log[-3000:]

    time.sleep(3)  # three of the first agent's heartbeats: it goes on holding node1
    assert first.proc.poll() is None, first.log[-3000:]
    assert _node_row(one_node)["pid"] == first.proc.pid
    with one_node.api("w") as w:
        inst = w.get(f"/api/management/instances/{iid}").json()
        assert (inst["state"], inst["pid"]) == ("READY", pid), inst
        assert backend_pids(MODEL, port) == [pid]
        chat = w.post("/v1/chat/completions", json=CHAT, timeout=30)
        assert chat.status_code == 200, chat.text
    events = _events(one_node, iid)
    assert [e["to_state"] for e in events][-1] == "READY" and "adopted" not in json.dumps(events), events
    assert "STOPPED -> ERROR" not in first.log and "not a legal transition" not in first.log, first.log[-3000:]


def test_an_agent_whose_node_was_taken_stops_without_touching_it(one_node, ready_model):
    """The row says another agent holds node1 now (as after a takeover of a silent agent): the
    agent's next heartbeat sees it, it exits 1 and writes nothing to the node's instances; the
    new holder is on this host, so the backend is left for it (it adopted it already)."""
    first = one_node.agents[NODE]  # stays in the cluster's list (stopped at its end) until it has exited
    iid, pid = ready_model["id"], ready_model["pid"]
    # The new holder: this shell's process, an agent of this host that is gone once the shell ends.
    taker = one_node.manage("shell", "-v", "0", "-c", (
        "import os; from hardware.models import Node; "
        "Node.objects.filter(name='node1').update(agent_id='f' * 32, agent_pid=os.getpid()); print(os.getpid())"
    )).stdout.strip()
    code = _exit_code(first, timeout=30)
    assert code == 1, f"the displaced agent went on (exit {code}):\n{first.log[-3000:]}"
    assert f"was taken by another node agent (pid {taker} on" in first.log, first.log[-3000:]
    del one_node.agents[NODE]
    with one_node.api("w") as w:
        inst = w.get(f"/api/management/instances/{iid}").json()
        assert (inst["state"], inst["pid"]) == ("READY", pid), inst
    assert pid_alive(pid)

    # The holder the row names is a dead pid of this host: the next agent takes the node at once
    # and adopts the backend, as after a kill -9.
    again = one_node.start_agent(NODE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "adopted backend" not in again.log and again.proc.poll() is None:
        time.sleep(0.3)
    assert "adopted backend" in again.log, again.log[-3000:]
    assert _node_row(one_node)["pid"] == again.proc.pid
    with one_node.api("w") as w:
        chat = w.post("/v1/chat/completions", json=CHAT, timeout=30)
        assert chat.status_code == 200, chat.text


def test_a_cleanly_stopped_agent_frees_its_node_at_once(one_node, ready_model):
    first = one_node.agents[NODE]
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(timeout=60) == 0, first.log[-3000:]
    del one_node.agents[NODE]
    assert _node_row(one_node)["agent_id"] == ""
    # Well inside the 30 s a heartbeat takes to go stale: only the freed row lets it in.
    successor = one_node.agents[NODE] = _agent(one_node, "node1-next")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "registered" not in successor.log and successor.proc.poll() is None:
        time.sleep(0.3)
    assert "registered" in successor.log, successor.log[-3000:]
    assert _node_row(one_node)["pid"] == successor.proc.pid


def test_an_agent_whose_node_went_to_another_host_kills_its_backends_and_writes_nothing(one_node, ready_model):
    """A holder on another host started its own backends for node1's instances: this agent's
    are orphans here, so it kills them, and leaves the rows (the new holder's) as they are."""
    agent, iid = one_node.agents[NODE], ready_model["id"]
    with one_node.api("w") as w:
        assert w.post("/api/management/restart", json={"id": iid}).status_code == 202
        inst = _wait(w, iid, {"READY", "ERROR"})
        assert inst["state"] == "READY", inst
    pid, before = inst["pid"], len(_events(one_node, iid))
    one_node.manage("shell", "-v", "0", "-c", (
        "from hardware.models import Node; "
        "Node.objects.filter(name='node1').update(agent_id='e' * 32, agent_pid=1, agent_host='elsewhere#00000000')"))
    code = _exit_code(agent, timeout=30)
    assert code == 1, f"the displaced agent went on (exit {code}):\n{agent.log[-3000:]}"
    assert "was taken by another node agent (pid 1 on elsewhere" in agent.log, agent.log[-3000:]
    del one_node.agents[NODE]
    assert not pid_alive(pid) and backend_pids(MODEL, inst["port"]) == []
    with one_node.api("w") as w:
        after = w.get(f"/api/management/instances/{iid}").json()
    assert (after["state"], after["pid"]) == ("READY", pid), after
    assert len(_events(one_node, iid)) == before
