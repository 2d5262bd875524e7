"""Cluster mode serving: a load through one web process runs on node-a's agent (nudged over
Redis), copied from the S3 store into that node's cache; another web process sees it live."""
import json
import time

import httpx
import pytest

from tests.cluster.harness import backend_secret
from tests.serving.conftest import backend_pids

pytestmark = pytest.mark.cluster


def _wait(client: httpx.Client, iid: int, states: set[str], timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        body = client.get(f"/api/management/instances/{iid}").json()
        if body["state"] in states:
            return body
        time.sleep(0.2)
    raise AssertionError(f"instance {iid} stayed {body.get('state')}: {body.get('state_message')}")


def test_load_on_a_node_through_one_web_process_and_unload_through_another(cluster, tiny_gguf):
    code = f"from pathlib import Path; from hub.store import get_store; get_store().upload_model('gguf/tiny-cluster', Path({str(tiny_gguf)!r}))"
    cluster.manage("shell", "-v", "0", "-c", code)
    with cluster.api("b") as b, cluster.api("a") as a:
        r = b.post("/api/management/load", json={"model_path": "gguf/tiny-cluster", "node": "node-a",
                                                  "model_name": "tiny-cluster"})
        assert r.status_code == 202, r.text
        body = r.json()
        assert body["node"] == "node-a" and body["backend"] == "llama-server"  # the CPU default where built
        inst = _wait(a, body["id"], {"READY", "ERROR"})
        assert inst["state"] == "READY", inst
        assert (cluster.root / "node-a" / "cache" / "gguf" / "tiny-cluster").is_dir()
        assert not (cluster.root / "node-b" / "cache" / "gguf" / "tiny-cluster").exists()
        assert backend_pids("tiny-cluster", inst["port"]) == [inst["pid"]]
        body_chat = {"model": "tiny-cluster", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        # The backend answers only with its secret; every web process reads it from the database.
        direct = f"http://127.0.0.1:{inst['port']}/v1/chat/completions"
        assert httpx.post(direct, timeout=30, json=body_chat).status_code == 401
        secret = backend_secret(cluster, body["id"])
        assert httpx.post(direct, timeout=30, json=body_chat,
                          headers={"Authorization": f"Bearer {secret}"}).status_code == 200
        for web in (a, b):
            chat = web.post("/v1/chat/completions", json=body_chat, timeout=30)
            assert chat.status_code == 200, chat.text
            assert secret not in web.get(f"/api/management/instances/{body['id']}").text
        dup = a.post("/api/management/load", json={"model_path": "gguf/tiny-cluster", "node": "node-b",
                                                   "model_name": "tiny-cluster"})
        assert dup.status_code == 409 and json.loads(dup.text)["error"]["code"] == "duplicate_model_name"
        assert a.post("/api/management/unload", json={"model_name": "tiny-cluster"}).status_code == 202
        stopped = _wait(b, body["id"], {"STOPPED"}, timeout=30)
        assert stopped["pid"] is None and backend_pids("tiny-cluster", inst["port"]) == []
