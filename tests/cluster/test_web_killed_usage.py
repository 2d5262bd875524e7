"""A web process killed with kill -9 loses no row of what it answered (issue 35 #5), in cluster mode:
PostgreSQL and Redis, one node agent and two web processes as separate OS processes, a tiny model
loaded through the API. Web process `a` writes its usage every 10 s (XGEN_USAGE_FLUSH, the most
allowed), so what it answered just before the kill sits in its memory (and its journal): a stream
its client cut after the first tokens, then answered chats, streamed and not, each with the
client's own X-Request-ID. `a` is killed with SIGKILL right after the last answer, then started
again on the same data dir: every request id is in /api/requests exactly once with the tokens the
client was told, and /api/usage for the key sums exactly those rows. On 7a3a6ad (and with
XGEN_USAGE_JOURNAL=false) the rows the process had not written were lost for good.

The engine is llama-server, the auto choice: llama-cpp-python 0.3.36 holds back a stream's text while
the tiny model's random bytes look like an unfinished UTF-8 character (each step detokenizing
everything so far), so a long stream may send nothing for minutes, never sees its client leave,
and holds the engine's one lock from the chats that follow (a 120 s timeout in CI, 1 run in 3 here)."""
from __future__ import annotations

import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.cluster.harness import Cluster, create_cluster, destroy_cluster, services_available
from tests.cluster.test_abandoned_requests import _usage_now, rows_of_key
from tests.procs import stop_process

pytestmark = pytest.mark.cluster
MODEL = "tiny-wk"
CHAT = "/v1/chat/completions"
ANSWERED = 8


@pytest.fixture(scope="module")
def wk_cluster(tmp_path_factory, s3_server, tiny_gguf) -> Iterator[Cluster]:
    missing = services_available()
    if missing:
        pytest.fail(f"cluster tests need PostgreSQL and Redis on loopback: {missing}")
    s3_server.reset()
    extra = {"XGEN_USAGE_FLUSH": "10"}
    if os.environ.get("XGEN_TEST_USAGE_JOURNAL"):  # "false": shows what this test catches without it
        extra["XGEN_USAGE_JOURNAL"] = os.environ["XGEN_TEST_USAGE_JOURNAL"]
    c = create_cluster(tmp_path_factory.mktemp("webkilled"), s3_endpoint=s3_server.endpoint,
                       s3_access=s3_server.access_key, s3_secret=s3_server.secret_key, extra_env=extra)
    try:
        c.start_agent("node-a")
        c.start_web("a")
        c.start_web("b")
        c.wait_nodes_online({"node-a"}, web="b")
        c.manage("hub_upload", str(tiny_gguf), "--format", "gguf", "--name", MODEL)
        with c.api("b") as client:
            r = client.post("/api/management/load", json={"model_path": f"gguf/{MODEL}", "model_name": MODEL,
                                                          "node": "node-a", "backend": "llama-server",
                                                          "extra_args": {"--ctx-size": 4096, "--parallel": 1}})
            assert r.status_code == 202, r.text
            deadline = time.monotonic() + 120
            while (inst := client.get(f"/api/management/instances/{r.json()['id']}").json())["state"] != "READY":
                assert time.monotonic() < deadline, f"the model never became READY: {inst}"
                time.sleep(0.3)
        deadline = time.monotonic() + 20
        while _chat(c, c.admin_key, str(uuid.uuid4()), stream=False).status_code != 200:
            assert time.monotonic() < deadline, f"web a never routed {MODEL}"
            time.sleep(0.3)
        yield c
    finally:
        destroy_cluster(c)


def _body(stream: bool, max_tokens: int = 8) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": uuid.uuid4().hex + " say something"}],
            "max_tokens": max_tokens, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


def _chat(c: Cluster, key: str, request_id: str, *, stream: bool) -> httpx.Response:
    return httpx.post(c.webs["a"].url + CHAT, json=_body(stream), timeout=120,
                      headers={"Authorization": f"Bearer {key}", "X-Request-ID": request_id})


def _told(r: httpx.Response, stream: bool) -> tuple[int, int] | None:
    """The prompt and completion tokens the client was told (7a3a6ad sent no stream usage: None)."""
    if not stream:
        usage = r.json()["usage"]
    else:
        events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
        usage = next((e["usage"] for e in reversed(events) if e.get("usage")), None)
    return (usage["prompt_tokens"], usage["completion_tokens"]) if usage else None


def _cut_stream(c: Cluster, key: str, request_id: str) -> None:
    """A stream its client closes once the first token event came."""
    host, port = c.webs["a"].url.removeprefix("http://").split(":")
    # 1,800 tokens whatever the random model samples (llama-server's ignore_eos): about 1 s, so the
    # console sees the client leave first
    payload = json.dumps({**_body(True, max_tokens=1800), "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nhost: %s\r\nauthorization: Bearer %s\r\nx-request-id: %s\r\n"
                  b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                  % (CHAT.encode(), host.encode(), key.encode(), request_id.encode(), len(payload), payload))
        data = b""
        while data.count(b"data: {") < 2:
            got = s.recv(65536)
            assert got, data[-500:]
            data += got


def _client_id(row: dict) -> str:
    """The client's own X-Request-ID of a request-log row (7a3a6ad kept it as the row's request_id)."""
    return row.get("client_request_id") or row["request_id"]


def test_a_web_process_killed_with_sigkill_loses_no_row_of_what_it_answered(wk_cluster):
    c = wk_cluster
    with c.api("b") as client:
        r = client.post("/api/keys", json={"name": f"k-{uuid.uuid4().hex[:8]}", "username": "admin"})
    assert r.status_code == 201, r.text
    key_id, key = r.json()["id"], r.json()["key"]

    cut_id = str(uuid.uuid4())
    _cut_stream(c, key, cut_id)
    time.sleep(1.5)  # the engine counts the cut stream's prompt; then it is recorded
    told: dict[str, tuple[int, int] | None] = {}
    for i in range(ANSWERED):
        request_id, stream = str(uuid.uuid4()), i % 2 == 1
        r = _chat(c, key, request_id, stream=stream)
        assert r.status_code == 200, r.text
        told[request_id] = _told(r, stream)
    written_before = {_client_id(row) for row in rows_of_key(c, key_id)}
    victim = c.webs.pop("a")
    victim.proc.send_signal(signal.SIGKILL)
    assert victim.proc.wait(timeout=10) == -signal.SIGKILL
    ids = [cut_id, *told]
    # the test is only worth something when the kill caught rows not written yet (a write every 10 s)
    assert set(ids) - written_before, "every row was written before the kill: nothing to lose"

    c.start_web("a")  # the same data dir: its start replays what the killed process left
    deadline = time.monotonic() + 30
    while len(rows := rows_of_key(c, key_id)) < len(ids) and time.monotonic() < deadline:
        time.sleep(0.3)
    time.sleep(3)  # the agent's and the web processes' replays and writes add nothing twice
    rows = rows_of_key(c, key_id)
    by_id: dict[str, list[dict]] = {}
    for row in rows:
        by_id.setdefault(_client_id(row), []).append(row)
    lost = [i for i in ids if i not in by_id]
    assert not lost, (f"{len(lost)} of {len(ids)} answered requests have no row after the kill "
                      f"({len(set(ids) - written_before)} were not written before it)")
    assert all(len(by_id[i]) == 1 for i in ids), {i: len(v) for i, v in by_id.items()}
    assert len(rows) == len(ids)
    assert all(told.values()), "every answer, streamed or not, tells its usage"
    for request_id, (prompt, completion) in told.items():
        row = by_id[request_id][0]
        assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == (200, prompt, completion), row
    cut = by_id[cut_id][0]
    assert cut["status"] == 499 and cut["prompt_tokens"] > 0, cut
    assert _usage_now(c, key_id) == {
        "requests": len(ids), "errors": 0, "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "completion_tokens": sum(r["completion_tokens"] for r in rows)}
    assert "usage journal" in c.webs["a"].log and "replayed" in c.webs["a"].log
    assert not list((c.root / "a" / "usage-journal").glob(f"{victim.proc.pid}-*")), "the killed process's journal is left"


def test_a_clean_stop_writes_everything_and_leaves_the_journal_empty(wk_cluster):
    """SIGTERM (a restart, a rolling update) writes what was counted at once, as before the
    journal, and deletes the journal's segments: nothing is left to replay, nothing counts twice."""
    c = wk_cluster
    request_id = str(uuid.uuid4())
    assert _chat(c, c.admin_key, request_id, stream=False).status_code == 200
    journal = c.root / "a" / "usage-journal"
    assert list(journal.glob("*.jsonl")), "the answered request is in a's journal until written"
    web = c.webs.pop("a")
    assert stop_process(web.proc, timeout=40) == 0
    assert not list(journal.iterdir()), list(journal.iterdir())  # no segment, and its lock file gone too
    with c.api("b") as client:
        rows = client.get("/api/requests", params={"request_id": request_id}).json()["items"]
    assert len(rows) == 1 and rows[0]["status"] == 200
