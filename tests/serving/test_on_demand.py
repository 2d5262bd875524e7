"""On-demand models end to end (issue 13): a real `manage.py serve` with its agent, the real
llama-cpp-python engine on the tiny model, and XGEN_NODE_MEMORY_MIB leaving room for one of them
(each tiny model is estimated at 514 MiB)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import KeyedConsole, start_console
from tests.procs import stop_process
from tests.serving.conftest import backend_pids, keyed_console, set_console_backends, wait_api

ENV = {"XGEN_RESTART_BACKOFF": "0", "XGEN_RECONCILE_INTERVAL": "1", "XGEN_STOP_GRACE": "5",
       "XGEN_NODE_MEMORY_MIB": "800", "XGEN_COLD_START_KEEPALIVE_S": "0", "XGEN_USAGE_FLUSH": "1",
       # Models used moments ago may go here (the grace that keeps them: tests/serving/test_eviction_guard.py).
       "XGEN_EVICT_GRACE_S": "0"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def od(tmp_path_factory) -> Iterator[KeyedConsole]:
    yield from keyed_console(tmp_path_factory.mktemp("on-demand"), extra_env=ENV)


def _load(od: KeyedConsole, tiny_gguf, name: str, **fields) -> dict:
    r = httpx.post(f"{od.url}/api/management/load", headers=od.auth, timeout=30,
                   json={"model_path": str(tiny_gguf), "model_name": name, "policy": "on_demand", **fields})
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 10  # the routing table is pushed the change (a few ms)
    while name not in _models(od):
        assert time.monotonic() < deadline, "the on_demand model never showed in /v1/models"
        time.sleep(0.02)
    return r.json()


def _inst(od: KeyedConsole, pk: int) -> dict:
    return httpx.get(f"{od.url}/api/management/instances/{pk}", headers=od.auth, timeout=10).json()


def _chat(od: KeyedConsole, name: str, **extra) -> httpx.Response:
    return httpx.post(f"{od.url}/v1/chat/completions", headers=od.auth, timeout=120,
                      json={"model": name, **CHAT, **extra})


def _unload(od: KeyedConsole, pk: int) -> None:
    httpx.post(f"{od.url}/api/management/unload", headers=od.auth, json={"id": pk}, timeout=10)
    wait_api(f"{od.url}/api/management/instances/{pk}", od.key, lambda b: b["state"] == "STOPPED", timeout=60)


def _timeline(od: KeyedConsole, pk: int) -> list[tuple[str, str, str]]:
    code = (f"import json; from serving.models import InstanceEvent; print(json.dumps(list(InstanceEvent.objects."
            f"filter(instance_id={pk}).values_list('from_state', 'to_state', 'message'))))")
    out = od.console.manage("shell", "-v", "0", "-c", code).stdout.strip().splitlines()[-1]
    return [tuple(row) for row in json.loads(out)]


def _models(od: KeyedConsole) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{od.url}/v1/models", headers=od.auth, timeout=10).json()["data"]}


def test_three_concurrent_requests_to_an_idle_model_start_one_backend(od, tiny_gguf):
    loaded = _load(od, tiny_gguf, "od-three", idle_ttl_s=0)
    assert loaded["state"] == "IDLE" and loaded["policy"] == "on_demand" and loaded["gpus"] == []
    inst = _inst(od, loaded["id"])
    assert inst["pid"] is None and inst["port"] is None and inst["memory"]["estimate_mib"] == 514
    assert _models(od)["od-three"]["status"] == "idle"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: _chat(od, "od-three"), range(3)))
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert all(a.json()["choices"][0]["message"]["role"] == "assistant" for a in answers)
    assert all(float(a.headers["x-xgen-cold-start"]) >= 0 for a in answers)
    ready = _inst(od, loaded["id"])
    assert ready["state"] == "READY"
    assert backend_pids("od-three", ready["port"]) == [ready["pid"]], "one backend process for three requests"
    starts = [row for row in _timeline(od, loaded["id"]) if row[:2] == ("IDLE", "PENDING")]
    assert len(starts) == 1 and starts[0][2] == ("started by a request; memory for the fit check: 514 MiB, "
                                                 "the estimate (no measurement of this shape yet)")
    assert _models(od)["od-three"]["status"] == "ready"
    warm = _chat(od, "od-three")
    assert warm.status_code == 200 and "x-xgen-cold-start" not in warm.headers
    metrics = httpx.get(f"{od.url}/metrics", headers=od.auth, timeout=10).text
    assert 'xgen_cold_starts_total{model="od-three"} 1.0' in metrics
    _unload(od, loaded["id"])
    assert backend_pids("od-three", ready["port"]) == []
    assert "od-three" not in _models(od)


def test_idle_unload_after_a_short_ttl_then_the_next_request_starts_it_again(od, tiny_gguf):
    loaded = _load(od, tiny_gguf, "od-ttl", idle_ttl_s=2)
    assert _chat(od, "od-ttl").status_code == 200
    first = _inst(od, loaded["id"])
    assert first["state"] == "READY" and first["idle_unload_at"] is not None
    url = f"{od.url}/api/management/instances/{loaded['id']}"
    idle = wait_api(url, od.key, lambda b: b["state"] == "IDLE", timeout=60)
    assert idle["pid"] is None and idle["port"] is None
    assert backend_pids("od-ttl", first["port"]) == [], "the idle backend's process is gone"
    assert any(to == "IDLE" and msg.startswith("idle unload") for _, to, msg in _timeline(od, loaded["id"]))
    again = _chat(od, "od-ttl")
    assert again.status_code == 200 and "x-xgen-cold-start" in again.headers
    second = _inst(od, loaded["id"])
    assert second["state"] == "READY" and second["pid"] != first["pid"]
    metrics = httpx.get(f"{od.url}/metrics", headers=od.auth, timeout=10).text
    assert 'xgen_idle_unloads{model="od-ttl"} 1.0' in metrics
    _unload(od, loaded["id"])


def _measured(od: KeyedConsole, pk: int) -> dict:
    """The READY instance once the agent has recorded what it holds (measured memory, issue 12 #4)."""
    return wait_api(f"{od.url}/api/management/instances/{pk}", od.key,
                    lambda b: b["state"] == "READY" and b["memory"]["measured_mib"] is not None, timeout=60)


def _squeeze(od: KeyedConsole, pk: int) -> tuple[int, int]:
    """Cap the node (what XGEN_NODE_MEMORY_MIB records) at what its instances hold now plus what
    instance `pk` needs (the figure its start is checked with), less 1 MiB: it fits only if
    something goes. (cap, need)"""
    code = ("from hardware.models import Node; from serving.control.capacity import holders, start_memory; "
            "from serving.models import ModelInstance; node = Node.objects.get(name='test-node'); "
            f"need = start_memory(ModelInstance.objects.get(pk={pk})).mib; "
            "cap = sum(i.memory_mib for i in holders(node)) + need - 1; "
            "Node.objects.filter(pk=node.pk).update(model_memory_mib=cap); print(cap, need)")
    cap, need = od.console.manage("shell", "-v", "0", "-c", code).stdout.split()[-2:]
    return int(cap), int(need)


def _uncap(od: KeyedConsole) -> None:
    od.console.manage("shell", "-v", "0", "-c", "from hardware.models import Node; "
                      f"Node.objects.filter(name='test-node').update(model_memory_mib={ENV['XGEN_NODE_MEMORY_MIB']})")


def test_a_request_for_b_evicts_idle_a_and_a_pinned_model_is_never_evicted(od, tiny_gguf):
    # Each step caps the node so that the next start fits only by making room (what a running
    # tiny model holds is measured: far less than its estimate).
    a = _load(od, tiny_gguf, "od-a", idle_ttl_s=0)
    b = _load(od, tiny_gguf, "od-b", idle_ttl_s=0)
    try:
        assert _chat(od, "od-a").status_code == 200
        a_ready = _measured(od, a["id"])
        _squeeze(od, b["id"])
        r = _chat(od, "od-b")
        assert r.status_code == 200, r.text
        a_after = _inst(od, a["id"])
        assert a_after["state"] == "IDLE" and a_after["pid"] is None
        assert backend_pids("od-a", a_ready["port"]) == []
        assert any(to == "IDLE" and msg == "evicted to make room for od-b" for _, to, msg in _timeline(od, a["id"]))
        # A pinned model holds its room: B's request is refused with the numbers, nothing is stopped.
        c = _load(od, tiny_gguf, "od-c", idle_ttl_s=0, pinned=True)
        _measured(od, b["id"])
        _squeeze(od, c["id"])
        assert _chat(od, "od-c").status_code == 200  # evicts B (unpinned, least recently used)
        assert _inst(od, b["id"])["state"] == "IDLE"
        c_held = _measured(od, c["id"])["memory"]["measured_mib"]
        cap, need = _squeeze(od, b["id"])
        refused = _chat(od, "od-b")
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "insufficient_capacity"
        assert f"od-b needs {need} MiB; test-node has {cap - c_held} MiB free of {cap} MiB offered to models" \
            in error["message"], error["message"]
        assert f"od-c (instance {c['id']}) {c_held} MiB (pinned or always)" in error["message"]
        assert _inst(od, c["id"])["state"] == "READY"
        # The API says the same for a clicked load: 409 does_not_fit with the numbers.
        clicked = httpx.post(f"{od.url}/api/management/load", headers=od.auth, timeout=30,
                             json={"model_path": str(tiny_gguf), "model_name": "od-clicked",
                                   "extra_args": {"--ctx-size": 1024}})  # a shape never measured: the estimate
        assert clicked.status_code == 409 and clicked.json()["error"]["code"] == "does_not_fit", clicked.text
        assert '"needed_mib": ' in clicked.json()["error"]["message"]
    finally:
        _uncap(od)
    for inst in (a, b, c):
        _unload(od, inst["id"])


def test_a_stream_waiting_for_a_cold_start_gets_loading_comments(od, tiny_gguf):
    loaded = _load(od, tiny_gguf, "od-sse", idle_ttl_s=0)
    lines = []
    with httpx.stream("POST", f"{od.url}/v1/chat/completions", headers=od.auth, timeout=120,
                      json={"model": "od-sse", **CHAT, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert "x-xgen-cold-start" in r.headers
        lines = [line for line in r.iter_lines() if line]
    assert lines[0].startswith(": loading "), lines[:3]
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and len(data) >= 2
    _unload(od, loaded["id"])


def test_a_client_that_leaves_during_a_cold_start_leaves_nothing_behind(od, tiny_gguf):
    loaded = _load(od, tiny_gguf, "od-gone", idle_ttl_s=0)
    body = json.dumps({"model": "od-gone", **CHAT}).encode()
    host, port = od.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + od.key.encode() + b"\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_api(f"{od.url}/api/management/instances/{loaded['id']}", od.key, lambda b: b["state"] != "IDLE",
                 timeout=30)
    # The start goes on (it is a desired state now); the one backend serves the next request.
    ready = wait_api(f"{od.url}/api/management/instances/{loaded['id']}", od.key, lambda b: b["state"] == "READY",
                     timeout=60)
    r = _chat(od, "od-gone")
    assert r.status_code == 200 and "x-xgen-cold-start" not in r.headers
    assert backend_pids("od-gone", ready["port"]) == [ready["pid"]]
    assert len([row for row in _timeline(od, loaded["id"]) if row[:2] == ("IDLE", "PENDING")]) == 1
    _unload(od, loaded["id"])


def test_a_failed_cold_start_answers_503_cold_start_failed(od, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(4096))  # not a model the engine can read
    loaded = _load(od, broken, "od-broken")
    answer = _chat(od, "od-broken")
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "cold_start_failed"
    assert "od-broken" in answer.json()["error"]["message"]
    assert _inst(od, loaded["id"])["state"] == "ERROR"
    _unload(od, loaded["id"])


# ---------------------------------------------------------------- autostart across a clean restart (17 #12)
def test_a_clean_restart_starts_only_autostart_models_and_readyz_waits_for_them(tmp_path, tiny_gguf):
    data = tmp_path / "console"
    env = {k: v for k, v in ENV.items() if k != "XGEN_NODE_MEMORY_MIB"}
    first = start_console(data, extra_env=env)
    try:
        set_console_backends(first)
        key = first.manage("createapikey", "--username", "admin").stdout.strip().splitlines()[-1]
        auth = {"Authorization": f"Bearer {key}"}
        ids = {}
        for name, autostart in (("boot-yes", True), ("boot-no", False)):
            r = httpx.post(f"{first.url}/api/management/load", headers=auth, timeout=30,
                           json={"model_path": str(tiny_gguf), "model_name": name, "autostart": autostart})
            assert r.status_code == 202 and r.json()["autostart"] is autostart, r.text
            ids[name] = r.json()["id"]
        od_id = httpx.post(f"{first.url}/api/management/load", headers=auth, timeout=30,
                           json={"model_path": str(tiny_gguf), "model_name": "boot-od", "policy": "on_demand",
                                 "start": True}).json()["id"]
        before = {}
        for name, pk in (*ids.items(), ("boot-od", od_id)):
            before[name] = wait_api(f"{first.url}/api/management/instances/{pk}", key,
                                    lambda b: b["state"] in ("READY", "ERROR"))
            assert before[name]["state"] == "READY", before[name]
    finally:
        assert stop_process(first.proc, timeout=60) == 0, first.log[-3000:]
    for name, inst in before.items():
        assert backend_pids(name, inst["port"]) == [], f"a clean stop stops {name}"

    second = start_console(data, extra_env=env)
    try:
        # Ready only once the autostart model is up.
        deadline = time.monotonic() + 90
        while httpx.get(f"{second.url}/readyz", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, httpx.get(f"{second.url}/readyz", timeout=10).text
            time.sleep(0.1)
        yes = httpx.get(f"{second.url}/api/management/instances/{ids['boot-yes']}", headers=auth, timeout=10).json()
        assert yes["state"] == "READY" and yes["pid"] != before["boot-yes"]["pid"]
        no = httpx.get(f"{second.url}/api/management/instances/{ids['boot-no']}", headers=auth, timeout=10).json()
        assert no["state"] == "STOPPED" and no["desired_state"] == "STOPPED" and no["pid"] is None
        assert "not marked autostart" in no["state_message"]
        idle = httpx.get(f"{second.url}/api/management/instances/{od_id}", headers=auth, timeout=10).json()
        assert idle["state"] == "IDLE" and idle["pid"] is None
        # Stopped, not forgotten: Restart starts it; the idle one starts on a request.
        r = httpx.post(f"{second.url}/api/management/restart", headers=auth, json={"id": ids["boot-no"]}, timeout=10)
        assert r.status_code == 202
        assert wait_api(f"{second.url}/api/management/instances/{ids['boot-no']}", key,
                        lambda b: b["state"] in ("READY", "ERROR"))["state"] == "READY"
        chat = httpx.post(f"{second.url}/v1/chat/completions", headers=auth, timeout=120,
                          json={"model": "boot-od", **CHAT})
        assert chat.status_code == 200 and "x-xgen-cold-start" in chat.headers
    finally:
        assert stop_process(second.proc, timeout=60) == 0, second.log[-3000:]
