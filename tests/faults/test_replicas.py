"""Replicas on real engines (issue 30): one real console (`manage.py serve`: web + agent) with
llama-server on the CPU and the tiny model. Two replicas on one node are two processes on two
ports that share the requests and survive the loss of one; scaling 1 -> 3 -> 1 with requests
running fails none, and a replica scaled down finishes its stream before it stops. The requests here
all send one prompt and are placed by least in flight (XGEN_ROUTING=least_inflight, the default, set
here so a change of default does not change these tests); prefix-aware routing is tested in
tests/faults/test_prefix_routing.py."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from tests.faults.conftest import FaultConsole, backend_pids, backends_console, serve_backends

ENDLESS = "root ::= [a-z ] root"  # the tiny random model streams exactly max_tokens tokens


@pytest.fixture(scope="module")
def console(tmp_path_factory) -> Iterator[FaultConsole]:
    yield from backends_console(tmp_path_factory.mktemp("replicas"), extra_env={"XGEN_ROUTING": "least_inflight"})


def _holders(c: FaultConsole, model: str) -> list[dict]:
    r = httpx.get(f"{c.url}/api/management/instances", headers=c.auth, timeout=10)
    r.raise_for_status()
    return sorted((i for i in r.json() if i["model_name"] == model and i["desired_state"] != "STOPPED"),
                  key=lambda i: i["replica"])


def _wait_ready(c: FaultConsole, model: str, n: int, timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = _holders(c, model)
        if len(rows) == n and all(i["state"] == "READY" for i in rows):
            return rows
        assert not any(i["state"] == "ERROR" for i in rows), [(i["id"], i["state_message"], i["error"]) for i in rows]
        time.sleep(0.1)
    raise AssertionError(f"never {n} READY: {[(i['id'], i['state'], i['state_message']) for i in rows]}")


FAILURES: list[str] = []  # what each refused request said (printed by a failing assertion)


@pytest.fixture(autouse=True)
def _own_failures():
    """Each test reports only the refusals it met (FAILURES is shared by the module's helpers)."""
    FAILURES.clear()


def _all_answered(statuses: list[int], what: str) -> None:
    """Every request answered 200 (FAILURES holds each refused request's message, with its
    connection's story). Until the http1 client learned that llama-server closes the connection
    after every streamed answer, about 1 request in 800 here reused such a connection and came back
    502 ("request 2 on a connection ..., idle 0.00 s before it"); this allowed one."""
    counts = Counter(statuses)
    assert statuses and set(counts) == {200}, (what, counts, FAILURES)


def _chat(c: FaultConsole, model: str, client: httpx.Client) -> int:
    r = client.post(f"{c.url}/v1/chat/completions", headers=c.auth, timeout=60,
                    json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    if r.status_code != 200:
        FAILURES.append(f"{time.strftime('%H:%M:%S')} {r.status_code} {r.text[:1000]}")
    return r.status_code


def _served_by(c: FaultConsole, model: str, n: int) -> Counter:
    """Which instance served each of the first `n` requests of the model (the request log)."""
    deadline = time.monotonic() + 30
    items: list[dict] = []
    while time.monotonic() < deadline:
        r = httpx.get(f"{c.url}/api/requests", params={"model": model, "limit": 1000}, headers=c.auth, timeout=10)
        items = r.json()["items"]
        if len(items) >= n:
            break
        time.sleep(0.3)
    assert len(items) >= n, f"{len(items)} request rows of {n}"
    return Counter(i["instance_id"] for i in items)


def _stopped_at(c: FaultConsole, pk: int) -> float:
    code = ("from serving.models import ModelInstance; "
            f"print(ModelInstance.objects.get(pk={pk}).stopped_at.timestamp())")
    return float(c.shell(code).splitlines()[-1])


def test_two_replicas_on_one_node_share_the_load_and_survive_a_sigkill(console, tiny_gguf):
    c = console
    r = c.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "duo", "backend": "llama-server",
                                        "replicas": 2,
                                        "extra_args": {"--ctx-size": 2048, "--threads": 1, "--threads-batch": 1}})
    assert r.status_code == 202, r.text
    assert [x["replica"] for x in r.json()["replicas"]] == [0, 1]
    rows = _wait_ready(c, "duo", 2)
    assert len({i["port"] for i in rows}) == 2 and len({i["pid"] for i in rows}) == 2, "two processes, two ports"
    for i in rows:
        assert backend_pids("duo", i["port"]) == [i["pid"]]
    listed = httpx.get(f"{c.url}/v1/models", headers=c.auth, timeout=10).json()["data"]
    entry = next(m for m in listed if m["id"] == "duo")
    assert entry["replicas"] == 2 and [(x["replica"], x["node"], x["state"]) for x in entry["instances"]] == [
        (0, "test-node", "READY"), (1, "test-node", "READY")]

    # 40 requests from 8 clients: every answer 200, each replica serves at least 30 %.
    with httpx.Client() as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda _: _chat(c, "duo", client), range(40)))
    assert statuses == [200] * 40
    served = _served_by(c, "duo", 40)
    assert set(served) == {i["id"] for i in rows}, served
    assert min(served.values()) >= 12, f"each replica serves >= 30 %: {served}"

    # SIGKILL one: the other serves every request sent after it; the killed one is restarted.
    killed = rows[1]
    os.kill(killed["pid"], signal.SIGKILL)
    with httpx.Client() as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
        after = list(pool.map(lambda _: _chat(c, "duo", client), range(24)))
    assert after == [200] * 24, Counter(after)
    again = c.wait_instance(killed["id"], lambda b: b["state"] == "READY" and b["restarts"] >= 1, timeout=90)
    assert again["pid"] != killed["pid"] and backend_pids("duo", again["port"]) == [again["pid"]]
    assert sorted(serve_backends(c.console.data_dir)) == sorted([rows[0]["pid"], again["pid"]])
    r = c.post("/api/management/unload", {"model_name": "duo"})
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 30
    while serve_backends(c.console.data_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert serve_backends(c.console.data_dir) == [], "unload stops every replica"


def _stream(c: FaultConsole, model: str, max_tokens: int) -> tuple[list[str], float]:
    """A streamed chat to the end: its data lines and when it ended."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "grammar": ENDLESS,
            "messages": [{"role": "user", "content": "tell me a long story"}]}
    lines = []
    with httpx.stream("POST", f"{c.url}/v1/chat/completions", headers=c.auth, json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                lines.append(line[len("data: "):])
    return lines, time.time()


@pytest.fixture(scope="module")
def long_gguf(tmp_path_factory):
    """The tiny model with a 65,536-token training context: llama.cpp caps a slot's context at the
    training one (2,048 for the default tiny model, about 1 s of streaming here), and the scale test
    needs streams that outlast its scale-down."""
    from hub.demo import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("long") / "tiny-long.gguf", seed=0, n_ctx=65536)


def test_scale_1_3_1_with_requests_running_fails_none_and_drains_streams(console, long_gguf):
    c = console
    # 4 slots of 16,384 tokens: each stream below (4,000 tokens) runs for seconds, not ~1 s.
    r = c.post("/api/management/load", {"model_path": str(long_gguf), "model_name": "elastic",
                                        "backend": "llama-server", "extra_args": {"--ctx-size": 65536, "--threads": 1}})
    assert r.status_code == 202, r.text
    _wait_ready(c, "elastic", 1)
    stop, paused = threading.Event(), threading.Event()
    statuses: list[int] = []

    def load_loop() -> None:
        with httpx.Client() as client:
            while not stop.is_set():
                if paused.is_set():
                    time.sleep(0.01)
                    continue
                statuses.append(_chat(c, "elastic", client))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        loops = [pool.submit(load_loop) for _ in range(3)]
        try:
            ended, draining = _scale_up_and_down(c, pool, paused)
        finally:
            stop.set()
        for loop in loops:
            loop.result(timeout=60)
    for lines, _ in ended:
        assert lines[-1] == "[DONE]", lines[-3:]
        assert all(json.loads(x)["choices"] is not None for x in lines[:-1] if x.startswith("{"))
    _all_answered(statuses, "scale 1 -> 3 -> 1")
    first_end = min(t for _, t in ended)
    for pk in draining:
        done = c.wait_instance(pk, lambda b: b["state"] == "STOPPED", timeout=60)
        assert "scaled down" in done["state_message"], done
    # Each drained replica had a stream: none stopped before the first stream ended.
    for pk in draining:
        assert _stopped_at(c, pk) >= first_end - 0.5, "a drained replica stopped while its stream ran"
    assert len(_holders(c, "elastic")) == 1
    print(f"\n{len(statuses)} requests during 1 -> 3 -> 1, all 200; streams of {[len(x) for x, _ in ended]} events "
          f"ended at {[round(t, 2) for _, t in ended]}; drained: "
          f"{[c.instance(pk)['state_message'] for pk in draining]}")


def _wait_in_flight(c: FaultConsole, predicate) -> dict[int, int]:
    """The console's requests in flight per replica (/v1/models), once `predicate` holds."""
    deadline = time.monotonic() + 20
    while True:
        listed = httpx.get(f"{c.url}/v1/models", headers=c.auth, timeout=10).json()["data"]
        entry = next(m for m in listed if m["id"] == "elastic")
        counts = {x["id"]: x["in_flight"] for x in entry["instances"]}
        if predicate(counts):
            return counts
        assert time.monotonic() < deadline, counts
        time.sleep(0.02)


def _scale_up_and_down(c: FaultConsole, pool, paused: threading.Event) -> tuple[list, list[int]]:
    """1 -> 3, a long stream on each replica, 3 -> 1: the streams' ends and the drained ids."""
    r = c.post("/api/management/scale", {"model_name": "elastic", "replicas": 3})
    assert r.status_code == 202, r.text
    assert (r.json()["previous"], r.json()["replicas"], len(r.json()["started"])) == (1, 3, 2)
    rows = _wait_ready(c, "elastic", 3)
    assert len({i["port"] for i in rows}) == 3
    time.sleep(1.5)  # requests reach the new replicas too
    # One long stream on each replica: the short requests pause while they start (least in flight
    # then puts each on a replica with none), and go on while the count goes down.
    paused.set()
    _wait_in_flight(c, lambda counts: sum(counts.values()) == 0)
    streams = []
    for n in range(1, 4):
        streams.append(pool.submit(_stream, c, "elastic", 4000))
        _wait_in_flight(c, lambda counts, n=n: sum(counts.values()) == n)
    assert sorted(_wait_in_flight(c, lambda counts: True).values()) == [1, 1, 1]
    paused.clear()
    r = c.post("/api/management/scale", {"model_name": "elastic", "replicas": 1, "drain_timeout_s": 90})
    print(f"\nscaled down at {time.time():.2f}")
    assert r.status_code == 202, r.text
    draining = r.json()["draining"]
    assert len(draining) == 2 and r.json()["replicas"] == 1
    ended = [s.result(timeout=120) for s in streams]
    return ended, draining


def _iso(value: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def test_autoscaling_follows_a_sustained_load_up_and_down_once_each(console, tiny_gguf):
    """min 1, max 2, target 1 in flight, a 3 s scale-up window and a 6 s scale-down delay: four
    clients streaming without pause bring up the second replica within the window plus its load
    time; when they stop it goes after the delay; then bursts shorter than the window change
    nothing: two changes in all, each a decision row."""
    c = console
    r = c.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "auto",
                                        "backend": "llama-server", "extra_args": {"--ctx-size": 16384, "--threads": 1}})
    assert r.status_code == 202, r.text
    _wait_ready(c, "auto", 1)
    r = c.post("/api/management/autoscale", {"model_name": "auto", "min_replicas": 1, "max_replicas": 2,
                                             "target_in_flight": 1, "scale_up_window_s": 3, "scale_down_delay_s": 6})
    assert r.status_code == 200 and r.json()["enabled"], r.text
    time.sleep(3.5)  # the manual load counts as a change: the loop waits a window after it
    stop = threading.Event()
    statuses: list[int] = []

    def streamer(tokens: int = 400) -> None:
        while not stop.is_set():
            lines, _ = _stream(c, "auto", tokens)
            statuses.append(200 if lines and lines[-1] == "[DONE]" else 500)

    began = time.time()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(streamer) for _ in range(4)]
        try:
            rows = _wait_ready(c, "auto", 2, timeout=60)
            up_at = time.time()
        finally:
            stop.set()
        for client in clients:
            client.result(timeout=60)
    stopped = time.time()
    second = max(rows, key=lambda i: i["replica"])
    decided_s = _iso(second["created_at"]) - began
    load_s = _iso(second["ready_at"]) - _iso(second["created_at"])
    # The up window (3 s) after the reports show the load (flushed each second, read by a 1 s tick),
    # with room for a loaded machine: a clean-clone CI run placed it after 6.9 s. What is held is
    # that it comes by itself within a few ticks of the window, not a figure of speed.
    assert decided_s <= 3 + 6, f"the second replica was placed {decided_s:.1f} s after the load began"
    assert up_at - began <= 3 + 6 + load_s + 2
    deadline = time.monotonic() + 30
    while len(_holders(c, "auto")) != 1:
        assert time.monotonic() < deadline, _holders(c, "auto")
        time.sleep(0.1)
    down_s = time.time() - stopped
    assert 6 - 1 <= down_s <= 6 + 6, f"scaled down {down_s:.1f} s after the load stopped (delay 6 s)"
    # A load that comes and goes within the window (on 1 s, off 2 s, for 18 s): no change. The
    # load the autoscaler sees lasts longer than the clients' 1 s: their last streams end after it
    # and the reports lag a flush (1 s). With 1.5 s on and 1.5 s off of 400-token streams, a
    # loaded clean-clone run saw 3 s of load and scaled up: the bursts did not stay inside the window.
    bursts = 0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(6):
            stop.clear()
            clients = [pool.submit(streamer, 100) for _ in range(4)]
            time.sleep(1.0)
            stop.set()
            for client in clients:
                client.result(timeout=60)
            bursts += 1
            time.sleep(2.0)
    assert len(_holders(c, "auto")) == 1
    decisions = c.post("/api/management/autoscale", {"model_name": "auto", "max_replicas": 2,
                                                     "target_in_flight": None}).json()["decisions"]
    assert [(d["from_replicas"], d["to_replicas"]) for d in reversed(decisions)] == [(1, 2), (2, 1)], decisions
    assert "scale-up window 3 s" in decisions[1]["reason"] and "scale-down delay 6 s" in decisions[0]["reason"]
    assert statuses and set(statuses) == {200}, (Counter(statuses), FAILURES)
    print(f"\nautoscaling: second replica placed {decided_s:.1f} s after the load began, READY after {load_s:.1f} s "
          f"more; removed {down_s:.1f} s after the load stopped; {bursts} bursts of 1 s: no change; {len(statuses)} "
          "streams, all complete")


def test_a_rolling_restart_takes_one_replica_at_a_time_and_fails_no_request(console, tiny_gguf):
    """Two replicas, new engine settings through POST /api/management/rollout while clients send
    requests and streams: never two replicas down at once, each READY before the next goes, every
    request answered 200 and every stream complete, both restarted with the new flags."""
    c = console
    r = c.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "roll", "backend": "llama-server",
                                        "replicas": 2, "extra_args": {"--ctx-size": 4096, "--threads": 1}})
    assert r.status_code == 202, r.text
    before = {i["id"]: i["pid"] for i in _wait_ready(c, "roll", 2)}
    stop = threading.Event()
    statuses: list[int] = []

    def chatter() -> None:
        with httpx.Client() as client:
            while not stop.is_set():
                statuses.append(_chat(c, "roll", client))

    def streamer() -> None:
        while not stop.is_set():
            lines, _ = _stream(c, "roll", 300)
            statuses.append(200 if lines and lines[-1] == "[DONE]" else 599)

    most_down = 0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(chatter) for _ in range(2)] + [pool.submit(streamer) for _ in range(2)]
        try:
            time.sleep(1)
            r = c.post("/api/management/rollout", {"model_name": "roll",
                                                   "extra_args": {"--ctx-size": 8192, "--threads": 1}})
            assert r.status_code == 202, r.text
            assert sorted(r.json()["order"]) == sorted(before)
            deadline = time.monotonic() + 120
            while True:
                rows = _holders(c, "roll")
                most_down = max(most_down, sum(i["state"] != "READY" for i in rows))
                if len(rows) == 2 and all(i["state"] == "READY" and i["pid"] != before[i["id"]] for i in rows):
                    break
                assert time.monotonic() < deadline, [(i["id"], i["state"], i["state_message"]) for i in rows]
                time.sleep(0.05)
            time.sleep(1)
        finally:
            stop.set()
        for client in clients:
            client.result(timeout=60)
    assert most_down == 1, "one replica at a time"
    _all_answered(statuses, "rolling restart")
    for pk in before:
        one = c.instance(pk)
        assert one["extra_args"]["--ctx-size"] == 8192 and "8192" in one["command"], one["command"]
        messages = [e["message"] for e in c.events(pk)]
        assert any(m.startswith("rolling restart (") for m in messages), messages
        assert any("rolling restart: drained in" in m for m in messages), messages
    print(f"\nrolling restart of 2 replicas: {len(statuses)} requests and streams during it, all 200")
