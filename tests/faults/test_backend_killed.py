"""A backend killed with -9 in the middle of a streamed answer, behind a real console."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from tests.faults.conftest import assert_timeline_chains, backend_pids, open_console, serve_backends

# A grammar that never allows the end: the tiny random model streams exactly max_tokens tokens.
ENDLESS = "root ::= [a-z ] root"


@pytest.mark.parametrize("server", ["uvicorn", "daphne"])
def test_backend_killed_mid_stream_ends_the_stream_and_is_restarted(tmp_path, tiny_gguf, consoles, server):
    c = open_console(tmp_path / "console", server=server)
    consoles.append(c)
    r = c.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "tiny-kill",
                                        "extra_args": {"--n_ctx": 4096}})
    assert r.status_code == 202, r.text
    iid = r.json()["id"]
    first = c.wait_instance(iid, lambda b: b["state"] in ("READY", "ERROR"))
    assert first["state"] == "READY", first
    pid = first["pid"]

    lines: list[str] = []
    killed_at = None
    body = {"model": "tiny-kill", "stream": True, "max_tokens": 2000, "grammar": ENDLESS,
            "messages": [{"role": "user", "content": "tell me a long story"}]}
    with httpx.Client(timeout=httpx.Timeout(30.0)) as client, \
            client.stream("POST", f"{c.url}/v1/chat/completions", headers=c.auth, json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():  # a hang would end in the 30 s read timeout
            if not line.startswith("data: "):
                continue
            lines.append(line[len("data: "):])
            if len(lines) == 3:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
    stream_ended_s = time.monotonic() - killed_at
    assert lines[-1] != "[DONE]", "the stream finished before the kill: it proves nothing"
    assert lines[-1].startswith("{\"error\""), lines[-3:]
    last = json.loads(lines[-1])
    assert set(last) == {"error"} and last["error"]["code"] == "upstream_error", last
    assert "backend stopped" in last["error"]["message"]
    assert all(x.startswith("{\"id\"") for x in lines[:-1]), lines[:-1][-5:]

    again = c.wait_instance(iid, lambda b: b["state"] == "READY" and b["restarts"] >= 1, timeout=60)
    recovered_s = time.monotonic() - killed_at
    assert again["restarts"] == 1 and again["pid"] != pid, again
    assert backend_pids("tiny-kill", again["port"]) == [again["pid"]]
    assert serve_backends(c.console.data_dir) == [again["pid"]], "exactly one backend process"
    events = c.events(iid)
    assert_timeline_chains(events, "READY")
    crash = [e for e in events if e["to_state"] == "ERROR"]
    assert len(crash) == 1 and "SIGKILL" in crash[0]["message"] and crash[0]["from_state"] == "READY", crash
    tail = events[events.index(crash[0]):]
    assert [e["to_state"] for e in tail] == ["ERROR", "PENDING", "LOADING", "WARMING", "READY"], tail

    chat = c.post("/v1/chat/completions", {"model": "tiny-kill", "max_tokens": 4,
                                           "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"
    print(f"\n[{server}] stream ended {stream_ended_s * 1000:.0f} ms after the kill; READY again after "
          f"{recovered_s:.2f} s")
    assert c.stop() == 0
    assert serve_backends(c.console.data_dir) == []


def test_backend_killed_during_a_whole_answer_is_a_502_then_ready_again(tmp_path, tiny_gguf, consoles):
    c = open_console(tmp_path / "console", server="daphne")
    consoles.append(c)
    r = c.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "tiny-kill-json",
                                        "extra_args": {"--n_ctx": 4096}})
    assert r.status_code == 202, r.text
    iid = r.json()["id"]
    first = c.wait_instance(iid, lambda b: b["state"] in ("READY", "ERROR"))
    assert first["state"] == "READY", first
    body = {"model": "tiny-kill-json", "max_tokens": 2000, "grammar": ENDLESS,
            "messages": [{"role": "user", "content": "tell me a long story"}]}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, f"{c.url}/v1/chat/completions", headers=c.auth, json=body, timeout=30)
        deadline = time.monotonic() + 10
        while True:  # the proxy's own count says when the request is at the backend
            listing = httpx.get(f"{c.url}/v1/models", headers=c.auth, timeout=5).json()["data"]
            if listing and listing[0]["instances"][0]["in_flight"] == 1:
                break
            assert time.monotonic() < deadline and not answer.done(), "the request never reached the backend"
            time.sleep(0.02)
        os.kill(first["pid"], signal.SIGKILL)
        resp = answer.result()
    assert resp.status_code == 502, resp.text
    err = resp.json()["error"]
    assert err["code"] in ("upstream_error", "upstream_unreachable") and err["message"], err
    again = c.wait_instance(iid, lambda b: b["state"] == "READY" and b["restarts"] >= 1, timeout=60)
    assert again["restarts"] == 1 and serve_backends(c.console.data_dir) == [again["pid"]]
    chat = c.post("/v1/chat/completions", {"model": "tiny-kill-json", "max_tokens": 2,
                                           "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    assert c.stop() == 0
