"""Cluster-wide admission (issue 25 #1): three web processes share one model's max_concurrency and
queue through Redis (reached through a TcpForwarder, so the test can take it away): the backend (a
stand-in that counts the requests it has open) never sees more than max_concurrency at once, the
queue goes by priority across processes, a SIGKILLed process's slots are free within the lease,
and Redis down falls back to each process's own queue (log line, counter) until it is back."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.cluster.harness import REDIS_HOST, create_cluster, destroy_cluster, services_available
from tests.cluster.tcp_forwarder import TcpForwarder
from tests.proxy.conftest import AiohttpBackend

pytestmark = pytest.mark.cluster

NODE = "adm-node"
MODEL = "adm-echo"
LEASE_S = 3


class CountingChat(AiohttpBackend):
    """Answers after the number of seconds the user message names; counts what it has open."""

    def __init__(self) -> None:
        self.open = 0
        self.max_open = 0
        self.arrivals: list[str] = []
        super().__init__()

    def add_routes(self, app) -> None:
        from aiohttp import web

        async def chat(request: web.Request) -> web.Response:
            body = await request.json()
            text = body["messages"][-1]["content"]
            self.arrivals.append(text)
            self.open += 1
            self.max_open = max(self.max_open, self.open)
            try:
                await asyncio.sleep(float(text.split()[0]))
            finally:
                self.open -= 1
            return web.json_response({"object": "chat.completion", "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                                                             "total_tokens": 2},
                                      "choices": [{"message": {"role": "assistant", "content": "ok"}}]})

        app.router.add_post("/v1/chat/completions", chat)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[tuple]:
    import psycopg

    missing = services_available()
    if missing:
        pytest.fail(f"cluster tests need PostgreSQL and Redis on loopback: {missing}")
    host, port = REDIS_HOST.split(":")
    forwarder = TcpForwarder(host, int(port)).start()
    cluster = create_cluster(tmp_path_factory.mktemp("adm"), s3_endpoint="http://127.0.0.1:9", s3_access="x",
                             s3_secret="x", extra_env={"XGEN_ADMISSION_LEASE_S": str(LEASE_S)})
    cluster.env["REDIS_URL"] = f"redis://127.0.0.1:{forwarder.port}/{cluster.redis_db}"
    backend = CountingChat()
    code = f"""
from django.utils import timezone
from hardware.models import Node
from serving.models import ModelInstance
node, _ = Node.objects.update_or_create(name={NODE!r}, defaults={{"address": "127.0.0.1", "last_heartbeat": timezone.now()}})
ModelInstance.objects.create(model_name={MODEL!r}, model_path="/m", backend="echo", node=node, max_concurrency=2,
                             port={backend.port}, state="READY", ready_at=timezone.now())
"""
    cluster.manage("shell", "-v", "0", "-c", code)
    stop = threading.Event()

    def beat() -> None:
        with psycopg.connect(cluster.env["DATABASE_URL"], autocommit=True) as conn:
            while not stop.wait(0.5):
                conn.execute("UPDATE hardware_node SET last_heartbeat = now() WHERE name = %s", (NODE,))

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        for web in ("a", "b", "c"):
            cluster.start_web(web)
            deadline = time.monotonic() + 20
            with cluster.api(web) as client:
                while MODEL not in {m["id"] for m in client.get("/v1/models").json()["data"]}:
                    assert time.monotonic() < deadline, f"web {web} never routed {MODEL}"
                    time.sleep(0.2)
        yield cluster, backend, forwarder
    finally:
        stop.set()
        beater.join(5)
        destroy_cluster(cluster)
        backend.stop()
        forwarder.down()


def _key(cluster, priority: str) -> str:
    with cluster.api("a") as client:
        r = client.post("/api/keys", json={"name": f"adm-{time.monotonic_ns()}", "username": "admin",
                                           "priority": priority})
    assert r.status_code == 201, r.text
    return r.json()["key"]


def _chat(cluster, web: str, text: str, key: str | None = None) -> httpx.Response:
    return httpx.post(f"{cluster.webs[web].url}/v1/chat/completions",
                      headers={"Authorization": f"Bearer {key or cluster.admin_key}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": text}]}, timeout=60)


def _fallbacks(cluster, web: str) -> float:
    with cluster.api(web) as client:
        text = client.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("xgen_admission_redis_fallback_total{"))


def test_thirty_requests_over_three_processes_never_exceed_max_concurrency(fleet) -> None:
    cluster, backend, _ = fleet
    backend.max_open = 0
    with ThreadPoolExecutor(30) as pool:
        answers = list(pool.map(lambda i: _chat(cluster, "abc"[i % 3], f"0.2 n{i}"), range(30)))
    assert [r.status_code for r in answers] == [200] * 30, [r.text for r in answers if r.status_code != 200]
    assert backend.max_open == 2  # three processes, one cap: not 3 x 2


def test_queue_goes_by_priority_across_processes(fleet) -> None:
    cluster, backend, _ = fleet
    low, high = _key(cluster, "low"), _key(cluster, "high")
    with ThreadPoolExecutor(8) as pool:
        holders = [pool.submit(_chat, cluster, "a", f"1.5 hold{i}") for i in range(2)]
        time.sleep(0.5)  # both slots held; now three low-priority requests wait (web b), then two high (web c)
        lows = [pool.submit(_chat, cluster, "b", f"0.1 low{i}", low) for i in range(3)]
        time.sleep(0.3)
        highs = [pool.submit(_chat, cluster, "c", f"0.1 high{i}", high) for i in range(2)]
        for f in holders + lows + highs:
            assert f.result().status_code == 200, f.result().text
    order = [a.split()[1][:-1] for a in backend.arrivals if a.split()[1].startswith(("low", "high"))][-5:]
    assert order == ["high", "high", "low", "low", "low"], backend.arrivals[-7:]


def test_redis_down_falls_back_to_the_process_then_cluster_wide_again(fleet) -> None:
    cluster, backend, forwarder = fleet
    before = _fallbacks(cluster, "a")
    forwarder.down()
    try:
        r = _chat(cluster, "a", "0.05 down")
        assert r.status_code == 200, r.text  # XGEN_ADMISSION_ON_REDIS_ERROR=local (the default)
        assert _fallbacks(cluster, "a") > before
        assert "admission: Redis failed" in cluster.webs["a"].log
    finally:
        forwarder.up()
    for web in ("a", "b", "c"):  # Redis is asked again REDIS_RETRY_S (1 s) after a failure
        deadline = time.monotonic() + 10
        while True:
            count = _fallbacks(cluster, web)
            assert _chat(cluster, web, "0.01 probe").status_code == 200
            if _fallbacks(cluster, web) == count:
                break
            assert time.monotonic() < deadline, f"web {web} still falls back 10 s after Redis came back"
            time.sleep(0.2)
    backend.max_open = 0
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda i: _chat(cluster, "abc"[i % 3], f"0.2 back{i}"), range(12)))
    assert all(r.status_code == 200 for r in answers)
    after = _fallbacks(cluster, "a")
    assert backend.max_open == 2  # cluster-wide again: 3 processes on their own would reach 6
    assert _fallbacks(cluster, "a") == after


def test_redis_down_with_refuse_answers_503(fleet) -> None:
    cluster, _, forwarder = fleet
    saved = dict(cluster.env)
    cluster.env["XGEN_ADMISSION_ON_REDIS_ERROR"] = "refuse"
    try:
        cluster.start_web("d")
    finally:
        cluster.env.clear()
        cluster.env.update(saved)
    deadline = time.monotonic() + 20
    with cluster.api("d") as client:
        while MODEL not in {m["id"] for m in client.get("/v1/models").json()["data"]}:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert _chat(cluster, "d", "0.01 up").status_code == 200
    forwarder.down()
    try:
        r = _chat(cluster, "d", "0.01 refused")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "admission_unavailable"
        assert _fallbacks(cluster, "d") >= 1
    finally:
        forwarder.up()
        web = cluster.webs.pop("d")
        web.proc.kill()
        web.proc.wait()


def test_sigkilled_process_frees_its_slots_within_the_lease(fleet) -> None:
    cluster, backend, _ = fleet
    with ThreadPoolExecutor(4) as pool:
        held = [pool.submit(_chat, cluster, "c", f"30 killed{i}") for i in range(2)]
        deadline = time.monotonic() + 10
        while backend.open < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        web = cluster.webs.pop("c")
        web.proc.kill()
        web.proc.wait()
        killed_at = time.monotonic()
        r = _chat(cluster, "a", "0.05 after-kill")
        waited = time.monotonic() - killed_at
        for f in held:
            with pytest.raises(httpx.HTTPError):
                f.result()
    assert r.status_code == 200, r.text
    assert waited <= LEASE_S * 4 / 3 + 1.5, waited  # the lease, then at most one renewal tick of web a
