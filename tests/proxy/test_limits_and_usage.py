"""Per-key limits and usage that lasts, through a real console: rpm and token quotas (429 with
Retry-After and OpenAI's headers), allowed models, stream usage asked of the backend and hidden
from a client that did not ask, usage by key equal to the usage the clients received (and still
there after a restart), the request log, and chargeback on the real engine."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from tests.conftest import start_console
from tests.procs import stop_process
from tests.proxy.conftest import BACKEND_NODE, AiohttpBackend, BackendPool, ProxyConsole

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
MARKER = "zebra-marker-5417"  # a prompt the database must never hold


class UsageBackend(AiohttpBackend):
    """OpenAI-shaped: JSON answers with USAGE; streams send a usage chunk only when asked
    (stream_options.include_usage), as OpenAI, vLLM and llama-server do. Keeps the bodies it got."""

    def add_routes(self, app) -> None:
        from aiohttp import web

        self.bodies: list[dict] = []

        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.bodies.append(body)
            if not body.get("stream"):
                return web.json_response({"object": "chat.completion", "usage": USAGE,
                                          "choices": [{"message": {"role": "assistant", "content": "ok"}}]})
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            wants_usage = (body.get("stream_options") or {}).get("include_usage")
            for i in range(3):
                chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": str(i)}}]}
                if wants_usage:
                    chunk["usage"] = None
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if wants_usage:
                final = {"object": "chat.completion.chunk", "choices": [], "usage": USAGE}
                await response.write(b"data: " + json.dumps(final).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response

        app.router.add_post("/v1/chat/completions", chat)


def _console(tmp_path_factory, name: str, data_dir=None):
    return start_console(data_dir or tmp_path_factory.mktemp(name), server="uvicorn", extra_env={
        "XGEN_NODE_STALE_AFTER": "3600", "XGEN_NODE_OFFLINE_AFTER": "7200", "XGEN_USAGE_FLUSH": "1"})


@pytest.fixture(scope="module")
def usage_backend() -> Iterator[UsageBackend]:
    backend = UsageBackend()
    yield backend
    backend.stop()


@pytest.fixture(scope="module")
def limited(tmp_path_factory, usage_backend) -> Iterator[ProxyConsole]:
    console = _console(tmp_path_factory, "limits-console")
    try:
        console.manage("createuser", "--username", "tess", "--role", "viewer", "--password", "tess-pass-123")
        admin_key = console.manage("createapikey", "--username", "admin").stdout.split()[-1]
        pc = ProxyConsole(console=console, key=admin_key)
        pc.ids = pc.set_instances([{"name": "usage-echo", "port": usage_backend.port},
                                   {"name": "other-echo", "port": usage_backend.port}])
        pc.wait_models({"usage-echo", "other-echo"})
        yield pc
    finally:
        code = stop_process(console.proc, timeout=30)
    assert code == 0, console.log[-3000:]
    assert "proxy failed" not in console.log and "Traceback" not in console.log, console.log[-5000:]


def new_key(pc: ProxyConsole, **limits) -> tuple[int, str]:
    body = {"name": f"k-{time.monotonic_ns()}", "username": "tess", **limits}
    r = httpx.post(f"{pc.url}/api/keys", json=body, headers=pc.auth)
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["key"]


def chat(pc: ProxyConsole, key: str, *, model: str = "usage-echo", **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": MARKER}], **extra}
    return httpx.post(f"{pc.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=30)


def stream(pc: ProxyConsole, key: str, **extra) -> tuple[list[dict], httpx.Headers]:
    body = {"model": "usage-echo", "messages": [{"role": "user", "content": MARKER}], "stream": True, **extra}
    events = []
    with httpx.stream("POST", f"{pc.url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
        return events, r.headers


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}
    return body["error"]


def test_rpm_3_the_fourth_request_in_the_minute_is_429_until_the_reset(limited):
    _, key = new_key(limited, rpm=3)
    answers = [chat(limited, key) for _ in range(3)]
    assert [r.status_code for r in answers] == [200, 200, 200]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in answers] == ["2", "1", "0"]
    assert all(r.headers["x-ratelimit-limit-requests"] == "3" for r in answers)
    assert answers[0].headers["x-ratelimit-reset-requests"].endswith("s")
    fourth = chat(limited, key)
    assert fourth.status_code == 429
    err = error_of(fourth)
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
    retry = int(fourth.headers["retry-after"])
    assert 15 <= retry <= 20, retry
    assert fourth.headers["x-ratelimit-limit-requests"] == "3"
    assert fourth.headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-reset-requests" in fourth.headers
    listing = httpx.get(f"{limited.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert listing.status_code == 200 and listing.headers["x-ratelimit-remaining-requests"] == "0"  # not counted
    time.sleep(retry + 0.2)
    after = chat(limited, key)
    assert after.status_code == 200, after.text
    assert after.headers["x-ratelimit-remaining-requests"] == "0"


def test_a_daily_token_quota_once_used_up_is_429_insufficient_quota(limited):
    kid, key = new_key(limited, daily_tokens=15)
    assert chat(limited, key).status_code == 200  # 10 tokens
    assert chat(limited, key).status_code == 200  # 10 < 15 when it came in
    refused = chat(limited, key)
    assert refused.status_code == 429 and error_of(refused)["code"] == "insufficient_quota"
    now = datetime.now(tz=UTC)
    midnight = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    assert abs(int(refused.headers["retry-after"]) - (midnight - now).total_seconds()) < 5
    # Raising the quota takes effect at once in the process that changed it.
    r = httpx.patch(f"{limited.url}/api/keys/{kid}", json={"daily_tokens": 1000}, headers=limited.auth)
    assert r.status_code == 200
    assert chat(limited, key).status_code == 200


def test_a_tpm_limit_carries_the_token_headers(limited):
    _, key = new_key(limited, tpm=15)
    first = chat(limited, key)
    assert first.status_code == 200 and first.headers["x-ratelimit-limit-tokens"] == "15"
    assert first.headers["x-ratelimit-remaining-tokens"] == "15" and "x-ratelimit-limit-requests" not in first.headers
    second = chat(limited, key)  # 10 tokens charged: 5 left
    assert second.status_code == 200 and second.headers["x-ratelimit-remaining-tokens"] == "5"
    third = chat(limited, key)  # 20 charged in all: 5 in debt
    assert third.status_code == 429 and error_of(third)["code"] == "rate_limit_exceeded"
    assert int(third.headers["retry-after"]) >= 20 and third.headers["x-ratelimit-remaining-tokens"] == "0"


def test_allowed_models_refuse_others_and_list_only_theirs(limited):
    _, key = new_key(limited, allowed_models=["usage-echo"])
    auth = {"Authorization": f"Bearer {key}"}
    assert chat(limited, key).status_code == 200
    refused = chat(limited, key, model="other-echo")
    assert refused.status_code == 403 and error_of(refused)["code"] == "model_not_allowed"
    unknown = chat(limited, key, model="no-such-model")
    assert unknown.status_code == 403 and error_of(unknown)["code"] == "model_not_allowed"
    listing = httpx.get(f"{limited.url}/v1/models", headers=auth).json()
    assert [m["id"] for m in listing["data"]] == ["usage-echo"]
    assert httpx.get(f"{limited.url}/v1/models/other-echo", headers=auth).status_code == 404
    everything = httpx.get(f"{limited.url}/v1/models", headers=limited.auth).json()
    assert {m["id"] for m in everything["data"]} == {"usage-echo", "other-echo"}


def test_the_proxys_own_refusals_carry_server_timing_rate_headers_and_the_messages_shape(limited):
    """Issue 14 on issue 15's proxy: a limited key's 200 and 429 both carry Server-Timing and the
    x-ratelimit-* headers; a refusal on /v1/messages comes in Anthropic's error shape."""
    _, key = new_key(limited, rpm=1, allowed_models=["usage-echo"])
    auth = {"Authorization": f"Bearer {key}"}
    ok = chat(limited, key)
    assert ok.status_code == 200 and ok.headers["x-ratelimit-remaining-requests"] == "0"
    assert "upstream;dur=" in ok.headers["server-timing"]
    refused = chat(limited, key)
    assert refused.status_code == 429 and error_of(refused)["code"] == "rate_limit_exceeded"
    assert refused.headers["server-timing"].startswith("proxy;dur=")
    assert refused.headers["x-ratelimit-limit-requests"] == "1"
    body = {"model": "usage-echo", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    messages = httpx.post(f"{limited.url}/v1/messages", json=body, headers={"x-api-key": key}, timeout=30)
    assert messages.status_code == 429 and messages.headers["x-ratelimit-limit-requests"] == "1"
    assert messages.json()["type"] == "error" and "server-timing" in messages.headers
    other = httpx.post(f"{limited.url}/v1/messages", json={**body, "model": "other-echo"}, headers=auth, timeout=30)
    assert other.status_code == 403 and other.json()["type"] == "error"
    listing = httpx.get(f"{limited.url}/v1/models", headers=auth)
    assert listing.headers["x-ratelimit-remaining-requests"] == "0" and "server-timing" in listing.headers


def test_stream_usage_is_asked_for_and_hidden_from_a_client_that_did_not_ask(limited, usage_backend):
    _, key = new_key(limited)
    events, _ = stream(limited, key)
    assert usage_backend.bodies[-1]["stream_options"] == {"include_usage": True}
    assert [e["choices"][0]["delta"]["content"] for e in events] == ["0", "1", "2"]
    assert all(not e.get("usage") for e in events)  # the usage chunk the proxy asked for never arrives
    events, _ = stream(limited, key, stream_options={"include_usage": True})
    assert events[-1]["usage"] == USAGE and events[-1]["choices"] == []
    chat(limited, key)
    assert "stream_options" not in usage_backend.bodies[-1]  # a plain request's body is passed as it came


def _usage_of(pc: ProxyConsole, key_id: int) -> dict:
    r = httpx.get(f"{pc.url}/api/usage", params={"group_by": "key", "key": key_id, "bucket": "day"},
                  headers=pc.auth)
    assert r.status_code == 200, r.text
    rows = r.json()["items"]
    return {f: sum(row[f] for row in rows) for f in ("requests", "errors", "prompt_tokens", "completion_tokens")}


def _wait_usage(pc: ProxyConsole, key_id: int, requests: int, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        got = _usage_of(pc, key_id)
        if got["requests"] >= requests or time.monotonic() > deadline:
            return got
        time.sleep(0.3)


def test_usage_by_key_equals_what_the_clients_received_and_outlives_a_restart(tmp_path_factory, usage_backend):
    data = tmp_path_factory.mktemp("restart-console")
    console = _console(tmp_path_factory, "restart", data_dir=data)
    try:
        console.manage("createuser", "--username", "tess", "--role", "viewer", "--password", "tess-pass-123")
        pc = ProxyConsole(console=console, key=console.manage("createapikey", "--username", "admin").stdout.split()[-1])
        pc.set_instances([{"name": "usage-echo", "port": usage_backend.port}])
        pc.wait_models({"usage-echo"})
        kid, key = new_key(pc)
        received = {"prompt_tokens": 0, "completion_tokens": 0}
        ids = []
        for _ in range(3):
            r = chat(pc, key, max_tokens=5)
            assert r.status_code == 200
            ids.append(r.headers["x-request-id"])
            for f in received:
                received[f] += r.json()["usage"][f]
        for _ in range(2):
            events, _ = stream(pc, key, stream_options={"include_usage": True})
            for f in received:
                received[f] += events[-1]["usage"][f]
        _, _ = stream(pc, key)  # the client asked for no usage; the proxy counted it all the same
        hidden = {"prompt_tokens": USAGE["prompt_tokens"], "completion_tokens": USAGE["completion_tokens"]}
        expected = {"requests": 6, "errors": 0, **{f: received[f] + hidden[f] for f in received}}
        assert _wait_usage(pc, kid, 6) == expected

        log = httpx.get(f"{pc.url}/api/requests", params={"key": kid}, headers=pc.auth).json()["items"]
        assert len(log) == 6 and {r["status"] for r in log} == {200}
        one = httpx.get(f"{pc.url}/api/requests", params={"request_id": ids[0]}, headers=pc.auth).json()["items"]
        assert len(one) == 1 and one[0]["key_id"] == kid and one[0]["user"] == "tess"
        assert one[0]["model"] == "usage-echo" and one[0]["node"] == BACKEND_NODE and one[0]["client"] == "127.0.0.1"
        assert one[0]["prompt_tokens"] == 7 and one[0]["completion_tokens"] == 3
        assert one[0]["ttft_ms"] > 0 and one[0]["duration_ms"] >= one[0]["ttft_ms"]
        streams = [r for r in log if r["stream"]]
        assert len(streams) == 3 and all(r["completion_tokens"] == 3 for r in streams)

        # The last interval is written at shutdown: a graceful stop loses nothing.
        chat(pc, key)
        assert stop_process(console.proc, timeout=30) == 0
        assert "Traceback" not in console.log
        console = _console(tmp_path_factory, "restart", data_dir=data)
        pc.console = console
        after = _usage_of(pc, kid)
        assert after == {**expected, "requests": 7, "prompt_tokens": expected["prompt_tokens"] + 7,
                         "completion_tokens": expected["completion_tokens"] + 3}
        csv = httpx.get(f"{pc.url}/api/usage", params={"group_by": "key", "key": kid, "format": "csv"},
                        headers=pc.auth)
        assert csv.headers["content-type"].startswith("text/csv")
        lines = csv.text.strip().splitlines()
        assert lines[0].startswith("bucket_start,key_id,key_name") and len(lines) >= 2
    finally:
        stop_process(console.proc, timeout=30)
    db = b"".join(f.read_bytes() for f in data.glob("xgen.sqlite3*"))
    assert b"usage-echo" in db and MARKER.encode() not in db  # prompts are never stored


def test_chargeback_on_two_instances_and_two_keys_on_the_real_engine(limited, tiny_gguf, tmp_path_factory):
    pool = BackendPool(tiny_gguf, tmp_path_factory.mktemp("cb-llama"))
    try:
        one, two = pool.start("cb-one"), pool.start("cb-two")
        code = f"""
import json
from django.utils import timezone
from hardware.models import Node
from serving.models import ModelInstance
node = Node.objects.get(name={BACKEND_NODE!r})
ids = [ModelInstance.objects.create(model_name=name, model_path="/m", backend="llama-cpp-python", node=node,
       port=port, state="READY", ready_at=timezone.now(), gpus=gpus).pk
       for name, port, gpus in (("cb-one", {one.port}, [0, 1]), ("cb-two", {two.port}, []))]
print(json.dumps(ids))
"""
        start = datetime.now(tz=UTC) - timedelta(seconds=1)
        ids = json.loads(limited.console.manage("shell", "-c", code).stdout.strip().splitlines()[-1])
        limited.wait_models({"usage-echo", "other-echo", "cb-one", "cb-two"})
        (ka, a), (kb, b) = new_key(limited), new_key(limited)
        spent: dict[tuple[int, str], float] = {}
        sent: dict[tuple[int, str], int] = {}
        for key_id, key, model, n in ((ka, a, "cb-one", 3), (kb, b, "cb-one", 1), (kb, b, "cb-two", 3)):
            for _ in range(n):
                t0 = time.perf_counter()
                r = httpx.post(f"{limited.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                               json={"model": model, "prompt": "once upon a time", "max_tokens": 32}, timeout=60)
                assert r.status_code == 200, r.text
                spent[(key_id, model)] = spent.get((key_id, model), 0.0) + time.perf_counter() - t0
                sent[(key_id, model)] = sent.get((key_id, model), 0) + 1
        busy: dict[tuple[int, str], float] = {}
        counted: dict[tuple[int, str], int] = {}
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            for key_id in (ka, kb):
                for row in httpx.get(f"{limited.url}/api/usage", headers=limited.auth,
                                     params={"group_by": "model", "key": key_id, "bucket": "day"}).json()["items"]:
                    busy[(key_id, row["model"])] = row["busy_seconds"]
                    counted[(key_id, row["model"])] = row["requests"]
            # every request flushed: a row appears with the first flush (a clean CI run at 3855b2f read
            # 0.0127 busy seconds for key a, before all 3 of its requests were in; the chargeback read
            # later charged 0.056 GPU-seconds on 2 GPUs, 0.028 s each)
            if counted == sent:
                break
            time.sleep(0.3)
        assert set(busy) == set(spent)
        for k, seconds in busy.items():  # busy time is the backend's part of what the client waited
            assert 0 < seconds <= spent[k], (k, seconds, spent[k])
        insts = {i: httpx.get(f"{limited.url}/api/management/instances/{i}", headers=limited.auth).json()
                 for i in ids}
        out = httpx.get(f"{limited.url}/api/usage/chargeback", headers=limited.auth,
                        params={"from": start.isoformat(), "group_by": "key"}).json()
        asked_at = datetime.now(tz=UTC)
        gpus = {"cb-one": 2, "cb-two": 1}
        charged = {i["key_id"]: i["gpu_seconds"] for i in out["items"]}
        assert charged[ka] == pytest.approx(2 * busy[(ka, "cb-one")], abs=0.01)
        assert charged[kb] == pytest.approx(2 * busy[(kb, "cb-one")] + 1 * busy[(kb, "cb-two")], abs=0.01)
        idle = {i["instance_id"]: i for i in out["idle"]}
        for iid in ids:
            inst = insts[iid]
            model = inst["model_name"]
            ready = (asked_at - datetime.fromisoformat(inst["ready_at"])).total_seconds()
            used = sum(s for (k, m), s in busy.items() if m == model)
            assert idle[iid]["gpus"] == gpus[model]
            assert idle[iid]["gpu_seconds"] == pytest.approx(gpus[model] * (ready - used), abs=gpus[model] * 2.0)
        total = out["total_gpu_seconds"]
        assert sum(i["gpu_seconds"] for i in out["items"]) + sum(i["gpu_seconds"] for i in out["idle"]) == \
            pytest.approx(total, abs=0.01)
        assert charged and all(0 < i["share"] < 1 for i in out["items"] if i["key_id"] in (ka, kb))
        by_user = httpx.get(f"{limited.url}/api/usage/chargeback", headers=limited.auth,
                            params={"from": start.isoformat(), "group_by": "user"}).json()
        tess = next(i for i in by_user["items"] if i["user"] == "tess")
        assert tess["gpu_seconds"] >= charged[ka] + charged[kb] - 0.01
    finally:
        pool.stop_all()


def test_a_stream_from_a_backend_without_stream_usage_is_counted(limited, tiny_gguf, tmp_path_factory):
    """llama-cpp-python's server ignores stream_options: its streams carry no usage. The proxy
    counts one completion token per token event then (its text may be empty: part of a character),
    and the engine counts the prompt, so a streamed answer is never free of quota."""
    pool = BackendPool(tiny_gguf, tmp_path_factory.mktemp("nousage-llama"))
    try:
        real = pool.start("no-stream-usage")
        code = f"""
from django.utils import timezone
from hardware.models import Node
from serving.models import ModelInstance
ModelInstance.objects.create(model_name="no-stream-usage", model_path="/m", backend="llama-cpp-python",
    node=Node.objects.get(name={BACKEND_NODE!r}), port={real.port}, state="READY", ready_at=timezone.now())
"""
        limited.console.manage("shell", "-c", code)
        limited.wait_models({"usage-echo", "other-echo", "no-stream-usage"})
        key_id, key = new_key(limited, tpm=100000)
        texts, usage_seen, request_id, finish = 0, False, "", None
        body = {"model": "no-stream-usage", "prompt": "once upon a time", "max_tokens": 12, "stream": True}
        with httpx.stream("POST", f"{limited.url}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {key}"}, timeout=60) as r:
            assert r.status_code == 200
            request_id = r.headers["x-request-id"]
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    usage_seen |= bool(event.get("usage"))
                    texts += bool(event["choices"] and event["choices"][0].get("text"))
                    finish = (event["choices"] or [{}])[0].get("finish_reason") or finish
        assert texts > 0 and not usage_seen  # the engine sent no usage, as said above
        deadline = time.monotonic() + 15
        rows = []
        while time.monotonic() < deadline and not rows:
            rows = httpx.get(f"{limited.url}/api/requests", headers=limited.auth,
                             params={"request_id": request_id}).json()["items"]
            time.sleep(0.3)
        assert rows and rows[0]["stream"] and rows[0]["usage_source"] == "console", rows
        assert rows[0]["completion_tokens"] >= texts and (finish != "length" or rows[0]["completion_tokens"] == 12)
        direct = httpx.post(f"{real.base_url}/v1/completions", json={**body, "stream": False, "max_tokens": 1},
                            timeout=60).json()["usage"]
        assert rows[0]["prompt_tokens"] == direct["prompt_tokens"]  # as the engine counts it
    finally:
        pool.stop_all()
