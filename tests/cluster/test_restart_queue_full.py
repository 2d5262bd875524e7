"""PostgreSQL and Redis restarted while a model's queue is full (issue 23, item 4), in cluster
mode (one node agent, one web process, separate OS processes): a stream holds the model's one
slot (max_concurrency 1), XGEN_QUEUE_MAX requests wait and one more is refused 429. Across each
restart nothing hangs (every client ends with an answer), the queue drains in order once the
stream ends, and the request log holds every request exactly once after the service is back.
It restarts the shared services: run it alone (`-m cluster`), not beside other tests."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.cluster.harness import (
    Cluster,
    create_cluster,
    destroy_cluster,
    postgres_restart_command,
    redis_restart_possible,
    restart_postgres,
    restart_redis,
    services_available,
)

pytestmark = pytest.mark.cluster
QUEUE_MAX = 3
ENDLESS = "root ::= [a-z ] root"


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory, s3_server, tiny_gguf) -> Iterator[Cluster]:
    missing = services_available()
    if missing:
        pytest.fail(f"cluster tests need PostgreSQL and Redis on loopback: {missing}")
    s3_server.reset()
    c = create_cluster(tmp_path_factory.mktemp("queue-restart"), s3_endpoint=s3_server.endpoint,
                       s3_access=s3_server.access_key, s3_secret=s3_server.secret_key,
                       extra_env={"XGEN_QUEUE_MAX": str(QUEUE_MAX), "XGEN_QUEUE_TIMEOUT_S": "300",
                                  "XGEN_USAGE_FLUSH": "1"})
    try:
        c.start_agent("node-a")
        c.start_web("a")
        c.wait_nodes_online({"node-a"}, web="a")
        c.manage("hub_upload", str(tiny_gguf), "--format", "gguf", "--name", "tiny-queue")
        with c.api("a") as client:
            r = client.post("/api/management/load", json={"model_path": "gguf/tiny-queue", "model_name": "tiny-q",
                                                          "node": "node-a", "max_concurrency": 1,
                                                          "backend": "llama-cpp-python", "extra_args": {"--n_ctx": 4096}})
            assert r.status_code == 202, r.text
            deadline = time.monotonic() + 120
            while client.get(f"/api/management/instances/{r.json()['id']}").json()["state"] != "READY":
                assert time.monotonic() < deadline, "the model never became READY"
                time.sleep(0.3)
        yield c
    finally:
        destroy_cluster(c)


class Ask(threading.Thread):
    def __init__(self, url: str, key: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.key, self.body = url, key, body
        self.status: int | None = None
        self.text = ""
        self.started_stream = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=self.body, timeout=httpx.Timeout(180.0),
                              headers={"Authorization": f"Bearer {self.key}"}) as r:
                self.status = r.status_code
                for text in r.iter_text():
                    self.text += text
                    self.started_stream.set()
        except httpx.HTTPError as exc:
            self.text += f"<{exc.__class__.__name__}>"
        self.started_stream.set()


def _depth(c: Cluster) -> float:
    text = httpx.get(f"{c.webs['a'].url}/metrics", headers={"Authorization": f"Bearer {c.admin_key}"}, timeout=10).text
    for line in text.splitlines():
        if line.startswith('xgen_queue_depth{model="tiny-q"}'):
            return float(line.split()[-1])
    return 0.0


def _rows(c: Cluster) -> list[dict]:
    r = httpx.get(f"{c.webs['a'].url}/api/requests", params={"model": "tiny-q", "limit": 1000},
                  headers={"Authorization": f"Bearer {c.admin_key}"}, timeout=10)
    return r.json()["items"] if r.status_code == 200 else []


@pytest.mark.parametrize("service", ["postgresql", "redis"])
def test_a_restart_with_the_queue_full_drains_it_and_loses_no_row(small_cluster, service):
    if service == "postgresql" and postgres_restart_command() is None:
        pytest.fail("no pg_ctlcluster to restart the loopback PostgreSQL with")
    if service == "redis" and not redis_restart_possible():
        pytest.fail("no redis-server/redis-cli to restart the loopback Redis with")
    c = small_cluster
    before = len(_rows(c))
    url, key = c.webs["a"].url, c.admin_key
    stream = Ask(url, key, {"model": "tiny-q", "stream": True, "max_tokens": 3000, "grammar": ENDLESS,
                            "messages": [{"role": "user", "content": "story"}]})
    assert stream.started_stream.wait(60) and stream.status == 200, stream.text
    waiting = []
    for i in range(QUEUE_MAX):
        waiting.append(Ask(url, key, {"model": "tiny-q", "max_tokens": 2, "messages": [{"role": "user", "content": f"q{i}"}]}))
        deadline = time.monotonic() + 20
        while _depth(c) != i + 1:
            assert time.monotonic() < deadline and stream.is_alive(), \
                f"request {i} never waited in the queue (the stream: {stream.text[-200:]!r})"
            time.sleep(0.05)
    over = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": "tiny-q", "max_tokens": 2, "messages": [{"role": "user", "content": "over"}]})
    assert over.status_code == 429 and over.json()["error"]["code"] == "queue_full", over.text

    took = restart_postgres() if service == "postgresql" else restart_redis()
    for ask in (stream, *waiting):
        ask.join(180)
        assert not ask.is_alive(), f"a client still waits {180} s after the {service} restart"
    assert stream.text.rstrip().endswith("data: [DONE]"), stream.text[-300:]
    assert [w.status for w in waiting] == [200] * QUEUE_MAX, [(w.status, w.text[-200:]) for w in waiting]

    expected = before + 1 + QUEUE_MAX + 1
    deadline = time.monotonic() + 60
    rows = _rows(c)
    while len(rows) < expected and time.monotonic() < deadline:
        time.sleep(0.5)
        rows = _rows(c)
    time.sleep(3)  # further flushes write nothing twice
    rows = _rows(c)
    print(f"\n{service} restart took {took:.1f} s; rows {[(r['status'], r['error']) for r in rows[:expected - before]]}")
    assert len(rows) == expected, [(r["status"], r["error"], r["request_id"]) for r in rows]
    assert len({r["request_id"] for r in rows}) == expected
    assert sorted(r["status"] for r in rows[:expected - before]) == [200] * (1 + QUEUE_MAX) + [429]
