"""Cluster mode in a real browser: a page on web process A shows, live, the log of a load that
the node agent of node B performs (agent -> Redis -> web A's websocket -> the page)."""
from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.browser.conftest import login
from tests.cluster.harness import Cluster, create_cluster, destroy_cluster, services_available

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3_server) -> Iterator[Cluster]:
    missing = services_available()
    if missing:
        pytest.fail(f"needs PostgreSQL and Redis on loopback: {missing}")
    s3_server.reset()
    c = create_cluster(tmp_path_factory.mktemp("cluster-live"), s3_endpoint=s3_server.endpoint,
                       s3_access=s3_server.access_key, s3_secret=s3_server.secret_key)
    try:
        c.start_agent("node-b")
        c.start_web("a")
        c.start_web("b")
        c.wait_nodes_online({"node-b"}, web="a")
        yield c
    finally:
        destroy_cluster(c)


def test_web_a_streams_the_log_of_a_load_on_node_b(cluster, page, tiny_gguf):
    cluster.manage("hub_upload", str(tiny_gguf), "--format", "gguf", "--name", "tiny-live")
    # Kill agent B, record the load while its node still counts as online, open the page on web A,
    # and only then start agent B: every log line must arrive live. Killed, not stopped: a clean
    # stop drains the node (issue 31), and a draining node takes no new load (409 node_draining).
    agent = cluster.agents.pop("node-b")
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(30)
    with cluster.api("b") as client:
        response = client.post("/api/management/load", json={
            "model_path": "gguf/tiny-live", "model_name": "tiny-live", "node": "node-b"})
    assert response.status_code == 202, response.text
    instance_id = response.json()["id"]
    # The engine's line once its HTTP server is up (node B built llama-server: the auto choice).
    started = {"llama-server": "listening on", "llama-cpp-python": "Uvicorn running on"}[response.json()["backend"]]

    frames: list[str] = []
    page.on("websocket", lambda ws: ws.on("framereceived", lambda payload: frames.append(str(payload))))
    login(page, cluster.webs["a"].url, "admin", "admin-pass-123")
    page.goto(f"{cluster.webs['a'].url}/instances/{instance_id}/")
    page.locator("#live-indicator", has_text="live").wait_for()
    assert started not in page.locator("#log").inner_text()

    cluster.start_agent("node-b")
    page.locator("#log", has_text=started).wait_for(timeout=60_000)
    page.locator(".badge", has_text="READY").first.wait_for(timeout=60_000)
    assert any(started in f for f in frames), "the log line did not come over web A's websocket"
    # The agent that did the work is node B's, a different process from web A.
    with cluster.api("a") as client:
        inst = client.get(f"/api/management/instances/{instance_id}").json()
    assert inst["node"] == "node-b" and inst["state"] == "READY"
