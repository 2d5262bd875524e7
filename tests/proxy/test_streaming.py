"""Streaming passthrough through a real console (daphne and uvicorn) to a real llama.cpp backend."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

# The grammar keeps the tiny model's output ASCII: random byte tokens would otherwise make
# llama.cpp hold back text (incomplete UTF-8) and release it in one burst at the end.
LONG = {"prompt": "once upon a time", "max_tokens": 480, "temperature": 0, "seed": 3, "stream": True,
        "grammar": "root ::= [a-z ]+"}
# Seconds of steady generation (on a server with n_ctx 2048).
STEADY = {"prompt": "a", "max_tokens": 1500, "temperature": 0, "stream": True, "grammar": "root ::= [a-z ]+"}


@pytest.fixture(scope="module", params=["daphne", "uvicorn"])
def console(request):
    return request.getfixturevalue("proxy_console_daphne" if request.param == "daphne" else "proxy_console")


def _timed_stream(url: str, headers: dict, body: dict) -> tuple[list[float], list[str]]:
    """Arrival time (since the request) and payload of every SSE data line."""
    times, payloads = [], []
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", headers=headers, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                times.append(time.perf_counter() - start)
                payloads.append(line[6:])
    return times, payloads


def _established_to(port: int) -> set[str]:
    """The local ends of client-side TCP connections to 127.0.0.1:port that are ESTABLISHED
    (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state = fields[1], fields[2], fields[3]
        if remote == f"0100007F:{port:04X}" and state == "01":
            found.add(local)
    return found


def _in_flight(console, name: str) -> int:
    listing = httpx.get(f"{console.url}/v1/models", headers=console.auth).json()
    return sum(i["in_flight"] for m in listing["data"] if m["id"] == name for i in m["instances"])


def test_chunks_arrive_as_the_backend_produces_them(console, backends):
    server = backends.start("streamer")
    console.set_instances([{"name": "streamer", "port": server.port}])
    console.wait_models({"streamer"})
    direct_t, direct = _timed_stream(server.base_url, {}, LONG)
    proxy_t, proxied = _timed_stream(console.url, console.auth, {**LONG, "model": "streamer"})

    def texts(payloads):
        return [json.loads(p)["choices"][0]["text"] for p in payloads if p != "[DONE]"]

    assert texts(proxied) == texts(direct) and proxied[-1] == "[DONE]"
    assert len(proxied) >= 400
    direct_spread = direct_t[-1] - direct_t[0]
    assert direct_spread > 0.1  # the backend itself produces chunks over time
    # Not buffered: through the proxy the chunks spread over the generation like the backend's own,
    # so the first one reaches the client long before the backend has finished.
    assert proxy_t[-1] - proxy_t[0] > 0.5 * direct_spread, (proxy_t[0], proxy_t[-1], direct_spread)


def test_a_client_that_disconnects_stops_the_backend(console, backends):
    server = backends.start("long", n_ctx=2048)
    console.set_instances([{"name": "long", "port": server.port}])
    console.wait_models({"long"})
    body = STEADY
    start = time.perf_counter()
    full = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    full_s = time.perf_counter() - start  # the whole generation, measured direct
    assert full.status_code == 200 and full.text.count("data: ") > 1000 and full_s > 1

    with httpx.stream("POST", f"{console.url}/v1/completions", headers=console.auth,
                      json={**body, "model": "long"}, timeout=60) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False)]
        assert any(line.startswith("data: ") for line in got)
        streaming = _established_to(server.port)
        assert len(streaming) == 1  # the proxy's upstream connection, mid-stream
        assert _in_flight(console, "long") == 1
        gauge = httpx.get(f"{console.url}/metrics", headers=console.auth).text
        assert re.search(r'xgen_inference_in_flight\{instance="\d+",model="long"\} 1\.0', gauge)
    # The client left: the proxy closes that upstream connection and forgets the request. (The
    # engine sends no usage in this stream, so the console then asks it to count the prompt, on
    # another connection that stays pooled for the next request: not the one watched here.)
    deadline = time.monotonic() + 5
    while ((streaming & _established_to(server.port)) or _in_flight(console, "long")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not streaming & _established_to(server.port)
    assert _in_flight(console, "long") == 0
    metrics = httpx.get(f"{console.url}/metrics", headers=console.auth).text
    assert re.search(r'xgen_inference_requests_total\{instance="\d+",model="long",status="499"\} 1\.0', metrics)
    assert 'xgen_inference_errors_total{instance' not in metrics  # a client leaving is not a backend error
    assert re.search(r'xgen_inference_in_flight\{instance="\d+",model="long"\} 0\.0', metrics)
    # The backend serves one request at a time: it answers at once only if it stopped generating.
    start = time.perf_counter()
    quick = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=60)
    assert quick.status_code == 200
    assert time.perf_counter() - start < 0.5 * full_s


def test_a_backend_that_dies_mid_stream_ends_it_with_an_error_event(console, backends):
    server = backends.start("doomed", n_ctx=2048)
    console.set_instances([{"name": "doomed", "port": server.port}])
    console.wait_models({"doomed"})
    body = {**STEADY, "model": "doomed"}
    payloads = []
    with httpx.stream("POST", f"{console.url}/v1/completions", headers=console.auth, json=body,
                      timeout=httpx.Timeout(60, read=10)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                payloads.append(line[6:])
                if len(payloads) == 3:
                    server.proc.kill()
    assert 3 < len(payloads) < 1000 and "[DONE]" not in payloads
    last = json.loads(payloads[-1])
    assert last["error"]["code"] == "upstream_error" and last["error"]["type"] == "upstream_error"
    server.proc.wait()
    assert _in_flight(console, "doomed") == 0
