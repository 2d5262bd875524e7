"""Requests abandoned at every moment, in cluster mode (issue 35 items 4 and 7): PostgreSQL and
Redis, one node agent and two web processes as separate OS processes, a tiny model loaded
through the API with max_concurrency 1 so a queue forms. Through each web process a client
leaves (a) while it waits in the queue behind a stream, (b) before the backend's first byte,
(c) mid-stream after tokens came, (d) right after `data: [DONE]`, (e) while the cold start of
an on_demand model it asked for is pending. Each request is in
/api/requests exactly once with the status and prompt tokens the engine counts (asked of the
engine directly), and /api/usage for the key sums exactly those rows. The console's own 429
(rpm) and 503 (no_backend) through both web processes count in /api/usage as requests and errors."""
from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.cluster.harness import Cluster, backend_secret, create_cluster, destroy_cluster, services_available
from tests.procs import stop_process
from tests.proxy.conftest import AiohttpBackend

pytestmark = pytest.mark.cluster
MODEL = "tiny-ab"
ENDLESS = "root ::= [a-z ] root"
# The holder's stream must outlast the queue of (a): the tiny model wrote 3,000 tokens in 1.0 s, and
# once a CI run took longer to queue and drop the six, one of them was answered (200, not 499).
HOLDER_TOKENS = 30000
CHAT = "/v1/chat/completions"
QUEUED = 6  # requests that wait behind the stream and leave together (under overload ~120 left no row)


@pytest.fixture(scope="module")
def ab_cluster(tmp_path_factory, s3_server, tiny_gguf) -> Iterator[tuple[Cluster, dict]]:
    missing = services_available()
    if missing:
        pytest.fail(f"cluster tests need PostgreSQL and Redis on loopback: {missing}")
    s3_server.reset()
    c = create_cluster(tmp_path_factory.mktemp("abandoned"), s3_endpoint=s3_server.endpoint,
                       s3_access=s3_server.access_key, s3_secret=s3_server.secret_key,
                       extra_env={"XGEN_USAGE_FLUSH": "1"})
    try:
        c.start_agent("node-a")
        c.start_web("a")
        c.start_web("b")
        c.wait_nodes_online({"node-a"}, web="a")
        c.manage("hub_upload", str(tiny_gguf), "--format", "gguf", "--name", "tiny-ab")
        with c.api("a") as client:
            r = client.post("/api/management/load", json={"model_path": "gguf/tiny-ab", "model_name": MODEL,
                                                          "node": "node-a", "max_concurrency": 1,
                                                          "backend": "llama-cpp-python",
                                                          "extra_args": {"--n_ctx": HOLDER_TOKENS + 2048}})
            assert r.status_code == 202, r.text
            deadline = time.monotonic() + 120
            while (inst := client.get(f"/api/management/instances/{r.json()['id']}").json())["state"] != "READY":
                assert time.monotonic() < deadline, f"the model never became READY: {inst}"
                time.sleep(0.3)
            for web in ("a", "b"):  # an on_demand model a web process's request cold-starts
                r = client.post("/api/management/load", json={"model_path": "gguf/tiny-ab", "node": "node-a",
                                                              "model_name": f"{MODEL}-od-{web}", "policy": "on_demand",
                                                              "idle_ttl_s": 0, "backend": "llama-cpp-python", "extra_args": {"--n_ctx": 4096}})
                assert r.status_code == 202 and r.json()["state"] == "IDLE", r.text
        for web in ("a", "b"):  # both routing tables hold them
            deadline = time.monotonic() + 20
            while _chat(c, web, c.admin_key, "hi", 1).status_code != 200 or not {
                    f"{MODEL}-od-a", f"{MODEL}-od-b"} <= {m["id"] for m in httpx.get(
                    f"{c.webs[web].url}/v1/models", headers={"Authorization": f"Bearer {c.admin_key}"}).json()["data"]}:
                assert time.monotonic() < deadline, f"web {web} never routed {MODEL}"
                time.sleep(0.3)
        yield c, inst
    finally:
        destroy_cluster(c)
    for web in ("a", "b"):
        log = (c.root / f"web-{web}.log").read_text(errors="replace")
        assert "proxy failed" not in log and "Traceback" not in log, log[-5000:]


def words(n: int) -> str:
    """A prompt of n words no other request began with (the engine's prompt cache never matches it)."""
    return uuid.uuid4().hex + " " + " ".join(f"w{i % 97}" for i in range(n))


def chat_body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, **extra}


def _chat(c: Cluster, web: str, key: str, prompt: str, max_tokens: int, model: str = MODEL) -> httpx.Response:
    return httpx.post(c.webs[web].url + CHAT, json={**chat_body(prompt, max_tokens), "model": model}, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def new_key(c: Cluster, **limits) -> tuple[int, str]:
    with c.api("a") as client:
        r = client.post("/api/keys", json={"name": f"k-{uuid.uuid4().hex[:8]}", "username": "admin", **limits})
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["key"]


def raw_post(c: Cluster, web: str, key: str, body: dict, request_id: str) -> socket.socket:
    """The request sent whole on a bare socket (the caller reads, or closes it to leave)."""
    host, port = c.webs[web].url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=120)
    s.sendall(b"POST %s HTTP/1.1\r\nhost: %s\r\nauthorization: Bearer %s\r\nx-request-id: %s\r\n"
              b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
              % (CHAT.encode(), host.encode(), key.encode(), request_id.encode(), len(payload), payload))
    return s


def read_until(s: socket.socket, done) -> bytes:
    data = b""
    while not done(data):
        got = s.recv(65536)
        assert got, data[-500:]
        data += got
    return data


def answer_request_id(data: bytes) -> str:
    head = data.split(b"\r\n\r\n", 1)[0].decode()
    return next(line.split(":", 1)[1].strip() for line in head.split("\r\n")
                if line.lower().startswith("x-request-id:"))


def depth(c: Cluster, web: str) -> float:
    text = httpx.get(f"{c.webs[web].url}/metrics", headers={"Authorization": f"Bearer {c.admin_key}"}, timeout=10).text
    for line in text.splitlines():
        if line.startswith(f'xgen_queue_depth{{model="{MODEL}"}}'):
            return float(line.split()[-1])
    return 0.0


def wait_depth(c: Cluster, web: str, want: float, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while depth(c, web) != want:
        assert time.monotonic() < deadline, f"web {web}: queue depth never {want}"
        time.sleep(0.05)


def rows_by_id(c: Cluster, request_id: str, *, timeout: float = 120) -> list[dict]:
    """The request log's rows for `request_id` (the console's or the client's own), waited for."""
    deadline = time.monotonic() + timeout
    with c.api("b") as client:
        while True:
            r = client.get("/api/requests", params={"request_id": request_id})
            assert r.status_code == 200, r.text
            if r.json()["items"] or time.monotonic() > deadline:
                return r.json()["items"]
            time.sleep(0.3)


def rows_of_key(c: Cluster, key_id: int) -> list[dict]:
    with c.api("a") as client:
        r = client.get("/api/requests", params={"key": key_id, "limit": 1000})
    assert r.status_code == 200, r.text
    return r.json()["items"]


def _usage_now(c: Cluster, key_id: int) -> dict:
    with c.api("b") as client:
        r = client.get("/api/usage", params={"group_by": "key", "key": key_id, "bucket": "day"})
    assert r.status_code == 200, r.text
    return {f: sum(row[f] for row in r.json()["items"]) for f in ("requests", "errors", "prompt_tokens",
                                                                   "completion_tokens")}


def usage_of(c: Cluster, key_id: int, *, requests: int, timeout: float = 30) -> dict:
    """The key's /api/usage totals once they count `requests`, read again 3 s later (further
    flushes of both web processes add nothing twice)."""
    deadline = time.monotonic() + timeout
    while _usage_now(c, key_id)["requests"] < requests and time.monotonic() < deadline:
        time.sleep(0.3)
    time.sleep(3)
    return _usage_now(c, key_id)


def engine_prompt_tokens(c: Cluster, inst: dict, body: dict) -> int:
    """The prompt tokens the engine itself counts for `body`, asked of the backend directly."""
    direct = {"model": MODEL, "messages": body["messages"], "max_tokens": 1}
    secret = backend_secret(c, inst["id"])
    r = httpx.post(f"http://127.0.0.1:{inst['port']}{CHAT}", json=direct, timeout=120,
                   headers={"Authorization": f"Bearer {secret}"} if secret else {})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_requests_abandoned_at_every_moment_are_logged_once_and_billed(ab_cluster):
    """Issue 35 item 4: a client timeout before the backend's first byte left no row and no
    usage, one per web process; under overload ~120 left none."""
    c, inst = ab_cluster
    key_id, key = new_key(c)
    cases: list[tuple[str, str, dict, str]] = []  # (web, moment, body, request id to look up)
    told_done: dict[str, tuple[int, int]] = {}
    for web in ("a", "b"):
        # the clients' own X-Request-IDs, UUIDs as SDKs send them (7a3a6ad forwarded them, and
        # llama-cpp-python refuses one that is not a UUID)
        ids = {m: str(uuid.uuid4()) for m in "abcde"}
        # (c) holds the model's one slot: an endless stream, read until tokens came
        holder = chat_body(words(10), HOLDER_TOKENS, stream=True, grammar=ENDLESS)
        s_c = raw_post(c, web, key, holder, ids["c"])
        head = read_until(s_c, lambda d: d.count(b"data: {") >= 3)
        assert head.startswith(b"HTTP/1.1 200"), head[:300]
        console_id_c = answer_request_id(head)
        # (a) QUEUED requests wait in the queue behind it, and their clients give up there at once
        queued = chat_body(words(10), 2)
        ids_a = [str(uuid.uuid4()) for _ in range(QUEUED)]
        s_a = [raw_post(c, web, key, queued, rid) for rid in ids_a]
        wait_depth(c, web, QUEUED)
        for s in s_a:
            s.close()
        wait_depth(c, web, 0)  # the console saw them leave
        s_c.close()  # (c) leaves mid-stream
        assert len(rows_by_id(c, console_id_c)) == 1
        # (b) a long prompt; the client leaves 30 ms after sending, long before any answer
        long = chat_body(words(800), 200)
        s_b = raw_post(c, web, key, long, ids["b"])
        time.sleep(0.03)
        s_b.close()
        assert len(rows_by_id(c, ids["b"])) == 1
        # (d) a stream read to data: [DONE], closed at once
        done = chat_body(words(10), 5, stream=True, stream_options={"include_usage": True})
        s_d = raw_post(c, web, key, done, ids["d"])
        data = read_until(s_d, lambda d: b"data: [DONE]" in d)
        s_d.close()
        usage = [json.loads(line[6:]) for line in data.decode(errors="replace").split("\n")
                 if line.startswith("data: {") and '"usage"' in line and '"usage":null' not in line.replace(" ", "")]
        told_done[ids["d"]] = (usage[-1]["usage"]["prompt_tokens"], usage[-1]["usage"]["completion_tokens"])
        assert answer_request_id(data) and told_done[ids["d"]][0] > 0
        # (e) an IDLE on_demand model: the request starts it, and its client leaves during the start
        cold = {**chat_body(words(10), 2), "model": f"{MODEL}-od-{web}"}
        s_e = raw_post(c, web, key, cold, ids["e"])
        with c.api(web) as client:
            deadline = time.monotonic() + 30
            while next(i for i in client.get("/api/management/instances").json()
                       if i["model_name"] == cold["model"])["state"] == "IDLE":
                assert time.monotonic() < deadline, "the request never started the on_demand model"
                time.sleep(0.05)
        s_e.close()
        cases += [(web, "e", cold, ids["e"]), *((web, "a", queued, rid) for rid in ids_a), (web, "b", long, ids["b"]), (web, "c", holder, console_id_c),
                  (web, "d", done, ids["d"])]

    got: dict[str, dict] = {}
    for web, moment, body, rid in cases:
        rows = rows_by_id(c, rid)
        assert len(rows) == 1, (web, moment, rows)  # exactly once
        row = rows[0]
        got[rid] = row
        where = (web, moment, row)
        if moment in "ae":  # never reached the engine: nothing to bill
            assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == (499, 0, 0), where
        elif moment == "b":
            assert (row["status"], row["completion_tokens"]) == (499, 0), where
            assert row["prompt_tokens"] == engine_prompt_tokens(c, inst, body) > 800, where
        elif moment == "c":
            assert row["status"] == 499 and 1 <= row["completion_tokens"] < HOLDER_TOKENS, where
            assert row["prompt_tokens"] == engine_prompt_tokens(c, inst, body) > 0, where
        else:
            assert row["status"] == 200, where
            assert (row["prompt_tokens"], row["completion_tokens"]) == told_done[rid], where
            assert row["prompt_tokens"] == engine_prompt_tokens(c, inst, body), where
    print("\n" + "\n".join(f"{web}{moment}: {got[rid]['status']} prompt {got[rid]['prompt_tokens']} "
                            f"completion {got[rid]['completion_tokens']} {got[rid]['error']!r}"
                            for web, moment, _, rid in cases))
    keyed = rows_of_key(c, key_id)
    assert sorted(r["request_id"] for r in keyed) == sorted(r["request_id"] for r in got.values()), keyed
    assert usage_of(c, key_id, requests=len(cases)) == {
        "requests": len(cases), "errors": 0,
        "prompt_tokens": sum(r["prompt_tokens"] for r in got.values()),
        "completion_tokens": sum(r["completion_tokens"] for r in got.values())}


def test_usage_counts_the_consoles_own_429_and_503_through_both_web_processes(ab_cluster):
    """Issue 35 item 7: /api/usage said errors 0 for a key whose requests got the console's own
    429 / 503; they were in the request log only."""
    c, _ = ab_cluster
    ghost = f"ghost-{uuid.uuid4().hex[:6]}"
    # A model meant to run on a node no agent serves: known, never READY, so 503 no_backend
    c.manage("shell", "-v", "0", "-c", f"""
from hardware.models import Node
from serving.models import ModelInstance
node, _ = Node.objects.get_or_create(name="ghost-node", defaults={{"address": "127.0.0.1"}})
ModelInstance.objects.create(model_name={ghost!r}, model_path="/m", backend="llama-cpp-python", node=node,
                             state="LOADING", desired_state="RUNNING")
""")
    for web in ("a", "b"):  # the admin key waits for both routing tables to know it
        deadline = time.monotonic() + 20
        while (r := _chat(c, web, c.admin_key, "hi", 1, model=ghost)).status_code != 503:
            assert r.status_code == 404 and time.monotonic() < deadline, r.text
            time.sleep(0.3)
        assert r.json()["error"]["code"] == "no_backend", r.text

    limited_id, limited = new_key(c, rpm=2)
    answered = [_chat(c, web, limited, words(5), 2) for web in ("a", "b")]
    assert [r.status_code for r in answered] == [200, 200], [r.text for r in answered]
    refused = [_chat(c, web, limited, words(5), 2) for web in ("a", "b")]
    assert [r.status_code for r in refused] == [429, 429], [r.text for r in refused]
    unserved_id, unserved = new_key(c)
    missing = [_chat(c, web, unserved, "hi", 2, model=ghost) for web in ("a", "b")]
    assert [(r.status_code, r.json()["error"]["code"]) for r in missing] == [(503, "no_backend")] * 2

    prompt = sum(r.json()["usage"]["prompt_tokens"] for r in answered)
    completion = sum(r.json()["usage"]["completion_tokens"] for r in answered)
    assert usage_of(c, limited_id, requests=4) == {"requests": 4, "errors": 2, "prompt_tokens": prompt,
                                                   "completion_tokens": completion}
    assert usage_of(c, unserved_id, requests=2) == {"requests": 2, "errors": 2, "prompt_tokens": 0,
                                                    "completion_tokens": 0}
    assert sorted(r["status"] for r in rows_of_key(c, limited_id)) == [200, 200, 429, 429]
    assert sorted(r["status"] for r in rows_of_key(c, unserved_id)) == [503, 503]


class BusyEngine(AiohttpBackend):
    """An engine that streams a token every 0.1 s without end and answers nothing else for a
    minute (busy): the console's request for its count of a prompt waits."""

    def add_routes(self, app) -> None:
        import asyncio

        from aiohttp import web

        async def busy(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            if not body.get("stream"):
                await asyncio.sleep(60)
                return web.json_response({"error": {"message": "late"}}, status=500)
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "x"}}]}
            try:
                while True:
                    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    await asyncio.sleep(0.1)
            except ConnectionResetError:  # the console closed the stream: its client left
                return response

        app.router.add_post("/{tail:.*}", busy)


def test_a_web_process_stopped_while_it_counts_left_requests_prompts_still_logs_them(ab_cluster):
    """A request left before the first byte or mid-stream waits for the engine to count its
    prompt; a web process stopped meanwhile (SIGTERM: a restart, a rolling update) gave up after
    10 s and the requests had no row and no usage."""
    import psycopg

    c, _ = ab_cluster
    engine, node, model = BusyEngine(), f"busy-{uuid.uuid4().hex[:6]}", f"busy-{uuid.uuid4().hex[:6]}"
    c.manage("shell", "-v", "0", "-c", f"""
from django.utils import timezone
from hardware.models import Node
from serving.models import ModelInstance
node = Node.objects.create(name={node!r}, address="127.0.0.1", last_heartbeat=timezone.now())
ModelInstance.objects.create(model_name={model!r}, model_path="/m", backend="llama-cpp-python", node=node,
                             port={engine.port}, state="READY", ready_at=timezone.now())
""")
    stop = threading.Event()

    def beat() -> None:  # no agent serves the node: the test keeps its heartbeat fresh
        with psycopg.connect(c.env["DATABASE_URL"], autocommit=True) as conn:
            while not stop.wait(0.5):
                conn.execute("UPDATE hardware_node SET last_heartbeat = now() WHERE name = %s", (node,))

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        web = c.start_web("c")
        deadline = time.monotonic() + 20
        while model not in {m["id"] for m in httpx.get(f"{web.url}/v1/models", timeout=10, headers={
                "Authorization": f"Bearer {c.admin_key}"}).json()["data"]}:
            assert time.monotonic() < deadline, "web c never routed the busy engine's model"
            time.sleep(0.2)
        key_id, key = new_key(c)
        before, during = str(uuid.uuid4()), str(uuid.uuid4())
        s_before = raw_post(c, "c", key, {**chat_body(words(20), 50), "model": model}, before)
        s_during = raw_post(c, "c", key, {**chat_body(words(20), 50, stream=True), "model": model}, during)
        read_until(s_during, lambda d: d.count(b"data: {") >= 3)
        time.sleep(0.5)
        s_before.close()  # before the engine's first byte
        s_during.close()  # mid-stream, 3 or more tokens in
        time.sleep(1)  # the console saw both clients leave and asks the engine for its counts
        began = time.monotonic()
        assert stop_process(web.proc, timeout=60) == 0, web.log[-3000:]
        print(f"\nweb c stopped in {time.monotonic() - began:.1f} s")
        c.webs.pop("c")
        rows = {rid: rows_by_id(c, rid, timeout=10) for rid in (before, during)}
        # In 2 full runs of tests/cluster here (never alone, 4 runs), rows[before] held two rows 2 ms
        # apart with two request ids: the whole rows and web c's log say whose (pytest cuts a dict).
        evidence = f"{json.dumps(rows, default=str, indent=1)}\nweb c log:\n{web.log[-6000:]}"
        assert [(r["status"], r["prompt_tokens"], r["completion_tokens"]) for r in rows[before]] == [(499, 0, 0)], evidence
        assert [(r["status"], r["prompt_tokens"]) for r in rows[during]] == [(499, 0)], evidence
        streamed = rows[during][0]["completion_tokens"]
        assert streamed >= 3, rows
        assert usage_of(c, key_id, requests=2, timeout=10) == {"requests": 2, "errors": 0, "prompt_tokens": 0,
                                                               "completion_tokens": streamed}
        assert "2 prompt count(s) unanswered after 10 s" in web.log and "Traceback" not in web.log, web.log[-3000:]
    finally:
        stop.set()
        beater.join(5)
        engine.stop()
