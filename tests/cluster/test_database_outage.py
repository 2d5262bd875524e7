"""A PostgreSQL outage under traffic does not take READY backends out of routing (issue 35 #1).

The database is taken away from one web process and one node agent for OUTAGE_S (25 s) by a
TCP forwarder of this test's own between them and the shared PostgreSQL (every connection cut,
new ones refused), while chats for a READY model run through the web process. No agent could
write a heartbeat meanwhile; the routing table must not drop the node for that once the
database is back (7a3a6ad answered 503 no_backend for up to a heartbeat interval after it
returned). The guard the staleness check exists for still holds: an agent killed during an
outage leaves routing within XGEN_NODE_STALE_AFTER of the database's return.

Heartbeat timings are the shipped defaults (5 s, stale after 20 s), not the harness's.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.cluster.harness import PG_ADMIN_DSN, Cluster, create_cluster, destroy_cluster, services_available
from tests.cluster.tcp_forwarder import TcpForwarder

pytestmark = pytest.mark.cluster

OUTAGE_S = float(os.environ.get("XGEN_TEST_DB_OUTAGE_S", "25"))
AFTER_S = 15.0  # traffic after the return: three heartbeat intervals
HEARTBEAT_S = 5
STALE_AFTER_S = 20
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


@dataclass
class Chats:
    """Chats through one web process in a background thread, every answer kept as (t, status, code)."""

    url: str
    key: str
    model: str
    answers: list[tuple[float, int, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {self.key}"}) as client:
            while not self._stop.is_set():
                try:
                    r = client.post("/v1/chat/completions", json={"model": self.model, **CHAT})
                    code = ""
                    if r.status_code >= 400:
                        try:
                            code = r.json()["error"]["code"] or ""
                        except Exception:
                            code = r.text[:120]
                    self.answers.append((time.monotonic(), r.status_code, code))
                except httpx.HTTPError as exc:
                    self.answers.append((time.monotonic(), 0, exc.__class__.__name__))
                time.sleep(0.1)

    def start(self) -> Chats:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def summary(self, since: float = 0.0, until: float = float("inf")) -> dict[tuple[int, str], int]:
        counts: dict[tuple[int, str], int] = {}
        for t, status, code in self.answers:
            if since <= t < until:
                counts[(status, code)] = counts.get((status, code), 0) + 1
        return counts


@pytest.fixture(scope="module")
def outage_cluster(tmp_path_factory, s3_server) -> Iterator[tuple[Cluster, TcpForwarder]]:
    missing = services_available()
    if missing:
        pytest.fail(f"cluster tests need PostgreSQL and Redis on loopback (.ci/run starts them): {missing}")
    from urllib.parse import urlsplit

    admin = urlsplit(PG_ADMIN_DSN)
    forwarder = TcpForwarder(admin.hostname or "127.0.0.1", admin.port or 5432)
    forwarder.up()
    s3_server.reset()
    c = create_cluster(tmp_path_factory.mktemp("db-outage"), s3_endpoint=s3_server.endpoint,
                       s3_access=s3_server.access_key, s3_secret=s3_server.secret_key,
                       extra_env={"XGEN_HEARTBEAT_INTERVAL": str(HEARTBEAT_S), "XGEN_NODE_STALE_AFTER": str(STALE_AFTER_S),
                                  "XGEN_NODE_OFFLINE_AFTER": "60", "XGEN_COLD_START_TIMEOUT_S": "120"})
    # Every process of the cluster (and its management commands) reaches PostgreSQL through the forwarder.
    database_url = c.env["DATABASE_URL"].replace(f"@{admin.hostname}:{admin.port or 5432}/",
                                                 f"@127.0.0.1:{forwarder.port}/")
    assert database_url != c.env["DATABASE_URL"], database_url
    c.env["DATABASE_URL"] = database_url
    try:
        c.start_agent("node-1")
        c.start_web("w")
        c.wait_nodes_online({"node-1"}, web="w")
        yield c, forwarder
    finally:
        if not forwarder.listening:  # a failed test left the database away
            forwarder.up()
        destroy_cluster(c)
        forwarder.down()


def _next_heartbeat(cluster: Cluster, node: str, after: object = None, timeout: float = 3 * HEARTBEAT_S) -> object:
    """The node's heartbeat time once it is another than `after` (the current one when None), read
    past the forwarder; returns just after the agent wrote it."""
    import psycopg

    dsn = PG_ADMIN_DSN.rsplit("/", 1)[0] + "/" + cluster.database
    with psycopg.connect(dsn, autocommit=True) as conn:
        def beat() -> object:
            return conn.execute("SELECT last_heartbeat FROM hardware_node WHERE name = %s", (node,)).fetchone()[0]

        first, deadline = (beat() if after is None else after), time.monotonic() + timeout
        while (now := beat()) == first:
            assert time.monotonic() < deadline, f"no heartbeat from {node} in {timeout} s"
            time.sleep(0.05)
        return now


def _wait_ready(client: httpx.Client, iid: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    inst: dict = {}
    while time.monotonic() < deadline:
        r = client.get(f"/api/management/instances/{iid}")
        if r.status_code == 200:
            inst = r.json()
            if inst["state"] == "READY":
                return inst
            assert inst["state"] != "ERROR", inst
        time.sleep(0.3)
    raise AssertionError(f"instance {iid} is not READY: {inst}")


def test_database_outage_keeps_ready_backends_routed(outage_cluster, tiny_gguf):
    cluster, forwarder = outage_cluster
    cluster.manage("hub_upload", str(tiny_gguf), "--format", "gguf", "--name", "tiny-outage")
    with cluster.api("w") as client:
        r = client.post("/api/management/load", json={"model_path": "gguf/tiny-outage", "model_name": "tiny-outage",
                                                      "node": "node-1"})
        assert r.status_code == 202, r.text
        backend_pid = _wait_ready(client, r.json()["id"])["pid"]
    web = cluster.webs["w"]
    chats = Chats(web.url, cluster.admin_key, "tiny-outage").start()
    try:
        deadline = time.monotonic() + 20
        while not chats.summary().get((200, "")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert chats.summary().get((200, "")), chats.summary()

        # 1. The database is away OUTAGE_S; the agent and the backend stay up. It goes 0.5 s after a
        # heartbeat's phase and returns 0.5 s after one: the agent's first beat that can land comes
        # a whole interval later (less 0.5 s), the worst case, not a chance of the agent's phase.
        last_beat = _next_heartbeat(cluster, "node-1")
        time.sleep((0.5 - OUTAGE_S) % HEARTBEAT_S)
        down_at = time.monotonic()
        forwarder.down()
        time.sleep(OUTAGE_S)
        forwarder.up()
        back_at = time.monotonic()
        # The agent tries again within a second of a failed beat, not a whole interval later (the
        # phase above puts its next regular beat 4.5 s after the return).
        _next_heartbeat(cluster, "node-1", after=last_beat, timeout=AFTER_S)
        beat_after = time.monotonic() - back_at
        time.sleep(max(0.0, AFTER_S - beat_after))
        during, after = chats.summary(down_at, back_at), chats.summary(back_at)
        print(f"\nchats during the {OUTAGE_S:.0f} s outage: {during}; in the {AFTER_S:.0f} s after: {after}; "
              f"the agent's first heartbeat came {beat_after:.1f} s after the return")
        refused = [(round(t - back_at, 2), s, c) for t, s, c in chats.answers if s != 200 and t >= down_at]
        # The READY backend on a live node is never refused for want of a backend; while the database
        # is away only what needs it (the key's lookup once its cache is out) may answer 503.
        no_backend = [t for t, _, c in refused if c == "no_backend"]
        assert not no_backend, (f"{len(no_backend)} answers 503 no_backend, {no_backend[0]} s to {no_backend[-1]} s "
                                "from the database's return")
        assert all(s == 503 and c == "database_unavailable" for _, s, c in refused), refused
        assert after.get((200, ""), 0) > 10, after
        assert set(after) == {(200, "")}, after
        assert beat_after < HEARTBEAT_S - 1.5, f"the agent's first heartbeat came {beat_after:.1f} s after the return"

        # 2. The guard: an agent that died during an outage leaves routing within the stale window
        # of the database's return (its backend still answers, so only the heartbeat can tell).
        forwarder.down()
        time.sleep(2)
        cluster.kill_agent("node-1")
        time.sleep(3)
        forwarder.up()
        back_at = time.monotonic()
        deadline = back_at + STALE_AFTER_S + 15
        while time.monotonic() < deadline:
            if any(c == "no_backend" for t, _, c in chats.answers if t > back_at):
                break
            time.sleep(0.5)
        dropped = [t - back_at for t, _, c in chats.answers if t > back_at and c == "no_backend"]
        print(f"the killed agent's node left routing {dropped[0] if dropped else None} s after the database returned")
        assert dropped, f"the dead agent's backend was still routed {STALE_AFTER_S + 15} s after the return"
        # A new agent adopts the orphaned backend (and stops it with the cluster).
        agent = cluster.start_agent("node-1")
        deadline = time.monotonic() + 60
        while f"adopted backend pid {backend_pid}" not in agent.log:
            assert time.monotonic() < deadline, "the restarted agent did not adopt the backend"
            assert agent.proc.poll() is None, f"the restarted agent exited: {agent.log[-2000:]}"
            time.sleep(0.3)
    finally:
        chats.stop()
        if "node-1" not in cluster.agents or f"adopted backend pid {backend_pid}" not in cluster.agents["node-1"].log:
            with contextlib.suppress(ProcessLookupError):
                os.kill(backend_pid, signal.SIGKILL)  # no agent of its own: leave no orphan
    while httpx.post(web.url + "/v1/chat/completions", json={"model": "tiny-outage", **CHAT}, timeout=30,
                     headers={"Authorization": f"Bearer {cluster.admin_key}"}).status_code != 200:
        assert time.monotonic() < deadline, "the restarted agent did not take the backend back"
        time.sleep(0.5)

