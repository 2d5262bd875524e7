"""Cluster mode: two web processes share one key's limits (in Redis), see a revoke pushed by the
other within moments, and write their usage into the same buckets."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.proxy.conftest import AiohttpBackend

pytestmark = pytest.mark.cluster

NODE = "echo-node"
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


class EchoChat(AiohttpBackend):
    def add_routes(self, app) -> None:
        from aiohttp import web

        async def chat(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response({"object": "chat.completion", "usage": USAGE,
                                      "choices": [{"message": {"role": "assistant", "content": "ok"}}]})

        app.router.add_post("/v1/chat/completions", chat)


@pytest.fixture(scope="module")
def echo_model(cluster) -> Iterator[str]:
    """A READY instance on a node of its own (no agent: the test keeps its heartbeat fresh)."""
    import psycopg

    backend = EchoChat()
    code = f"""
from django.utils import timezone
from hardware.models import Node
from serving.models import ModelInstance
node, _ = Node.objects.update_or_create(name={NODE!r}, defaults={{"address": "127.0.0.1", "last_heartbeat": timezone.now()}})
ModelInstance.objects.create(model_name="shared-echo", model_path="/m", backend="echo", node=node,
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
        for web in ("a", "b"):
            deadline = time.monotonic() + 15
            with cluster.api(web) as client:
                while "shared-echo" not in {m["id"] for m in client.get("/v1/models").json()["data"]}:
                    assert time.monotonic() < deadline, f"web {web} never routed shared-echo"
                    time.sleep(0.2)
        yield "shared-echo"
    finally:
        stop.set()
        beater.join(5)
        backend.stop()


def _key(cluster, **limits) -> tuple[int, str]:
    with cluster.api("a") as client:
        r = client.post("/api/keys", json={"name": f"shared-{time.monotonic_ns()}", "username": "admin", **limits})
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["key"]


def _chat(cluster, web: str, key: str, model: str) -> httpx.Response:
    return httpx.post(f"{cluster.webs[web].url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}]}, timeout=30)


def test_two_web_processes_share_one_keys_rpm(cluster, echo_model):
    _, key = _key(cluster, rpm=3)
    answers = [_chat(cluster, web, key, echo_model) for web in ("a", "b", "a")]
    assert [r.status_code for r in answers] == [200, 200, 200]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in answers] == ["2", "1", "0"]
    fourth = _chat(cluster, "b", key, echo_model)
    assert fourth.status_code == 429, fourth.text
    assert json.loads(fourth.text)["error"]["code"] == "rate_limit_exceeded"
    assert 15 <= int(fourth.headers["retry-after"]) <= 20
    assert fourth.headers["x-ratelimit-limit-requests"] == "3"


def test_two_web_processes_share_one_keys_token_quota(cluster, echo_model):
    kid, key = _key(cluster, daily_tokens=25)
    for web in ("a", "b", "a"):  # 10 tokens each; each answer's charge reaches Redis within a second
        assert _chat(cluster, web, key, echo_model).status_code == 200
        time.sleep(1.0)
    refused = _chat(cluster, "b", key, echo_model)
    assert refused.status_code == 429 and json.loads(refused.text)["error"]["code"] == "insufficient_quota"
    # Both processes wrote their part of the key's usage into the same buckets.
    deadline = time.monotonic() + 20
    with cluster.api("b") as client:
        while True:
            rows = client.get("/api/usage", params={"key": kid, "group_by": "key"}).json()["items"]
            total = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
            if (total == 30 and sum(r["requests"] for r in rows) == 4) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        log = client.get("/api/requests", params={"key": kid}).json()["items"]
    # The refusal is one of the key's requests and its one error (issue 35 #7: usage shows every
    # answer the key got, the console's own 429 included), with no tokens.
    assert total == 30 and sum(r["requests"] for r in rows) == 4 and sum(r["errors"] for r in rows) == 1
    assert sorted(r["status"] for r in log) == [200, 200, 200, 429]


def test_a_revoke_through_one_web_process_reaches_the_other_at_once(cluster, echo_model):
    kid, key = _key(cluster)
    assert _chat(cluster, "b", key, echo_model).status_code == 200  # cached by web b (XGEN_API_KEY_CACHE=5)
    with cluster.api("a") as client:
        assert client.delete(f"/api/keys/{kid}").status_code == 200
    started = time.monotonic()
    while _chat(cluster, "b", key, echo_model).status_code != 401:
        assert time.monotonic() - started < 3, "the revoke was not pushed to web b"
        time.sleep(0.1)


def test_two_keys_of_a_team_on_two_web_processes_share_the_teams_quota(cluster, echo_model):
    """Issue 26 #4: a team's daily quota, counted in Redis over every key of the team and every web
    process; both keys are refused once it is used, on both processes, and a change of the team's
    quota through one process reaches the other's key cache at once."""
    with cluster.api("a") as client:
        team = client.post("/api/teams", json={"name": f"team-{time.monotonic_ns()}", "daily_tokens": 25}).json()
    _, first = _key(cluster, team=team["slug"])
    _, second = _key(cluster, team=team["slug"])
    for web, key in (("a", first), ("b", second), ("a", second)):  # 10 tokens each
        assert _chat(cluster, web, key, echo_model).status_code == 200
        time.sleep(1.0)  # each answer's charge reaches Redis within a second
    for web in ("a", "b"):
        for key in (first, second):
            refused = _chat(cluster, web, key, echo_model)
            assert refused.status_code == 429, (web, refused.text)
            error = json.loads(refused.text)["error"]
            assert error["code"] == "insufficient_quota" and f"team '{team['name']}'" in error["message"]
    with cluster.api("b") as client:
        assert client.patch(f"/api/teams/{team['id']}", json={"daily_tokens": 1000}).status_code == 200
    started = time.monotonic()
    while _chat(cluster, "a", first, echo_model).status_code != 200:
        assert time.monotonic() - started < 3, "the team's new quota was not pushed to web a"
        time.sleep(0.1)
