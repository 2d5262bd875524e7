"""Routing by model name, replicas balanced, dead replicas skipped, and the table following the DB."""
from __future__ import annotations

import httpx
import pytest

PROMPT = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0, "seed": 7}


def _complete(url: str, headers: dict | None = None, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=headers or {}, json={**PROMPT, **extra}, timeout=60)


@pytest.fixture(scope="module")
def two_llms(proxy_console, backends, tiny_gguf_b):
    alpha = backends.start("alpha")
    beta = backends.start("beta", model=tiny_gguf_b)
    return alpha, beta


def test_requests_go_to_the_backend_named_by_model(proxy_console, two_llms):
    alpha, beta = two_llms
    proxy_console.set_instances([{"name": "alpha", "port": alpha.port}, {"name": "beta", "port": beta.port}])
    proxy_console.wait_models({"alpha", "beta"})
    direct_alpha = _complete(alpha.base_url).json()["choices"][0]["text"]
    direct_beta = _complete(beta.base_url).json()["choices"][0]["text"]
    assert direct_alpha != direct_beta  # different weights: the text tells which backend answered
    for _ in range(2):
        via_alpha = _complete(proxy_console.url, proxy_console.auth, model="alpha")
        via_beta = _complete(proxy_console.url, proxy_console.auth, model="beta")
        assert via_alpha.status_code == 200 and via_beta.status_code == 200
        assert via_alpha.json()["choices"][0]["text"] == direct_alpha
        assert via_beta.json()["choices"][0]["text"] == direct_beta


def test_replicas_share_traffic_and_a_killed_replica_is_skipped(proxy_console, backends):
    one = backends.start("gamma")
    two = backends.start("gamma")
    ids = proxy_console.set_instances([{"name": "gamma", "port": one.port}, {"name": "gamma", "port": two.port}])
    listing = proxy_console.wait_models({"gamma"})
    assert listing["data"][0]["replicas"] == 2
    for _ in range(10):
        assert _complete(proxy_console.url, proxy_console.auth, model="gamma", max_tokens=1).status_code == 200
    served = [backends.log(s).count('"POST /v1/completions HTTP/1.1" 200') for s in (one, two)]
    assert sum(served) == 10 and min(served) >= 3, served  # both replicas took traffic (the backends' own logs)

    # Least outstanding requests: while one replica streams, short requests all go to the other.
    def counts():
        return [backends.log(s).count('"POST /v1/completions HTTP/1.1" 200') for s in (one, two)]

    def in_flight():
        listing = httpx.get(f"{proxy_console.url}/v1/models", headers=proxy_console.auth).json()
        by_port = {i["id"]: i["in_flight"] for i in listing["data"][0]["instances"]}
        return [by_port[ids[0]], by_port[ids[1]]]

    before = counts()
    with httpx.stream("POST", f"{proxy_console.url}/v1/completions", headers=proxy_console.auth,
                      json={"prompt": "a", "model": "gamma", "max_tokens": 480, "temperature": 0, "stream": True},
                      timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        busy = [a - b for a, b in zip(counts(), before, strict=True)].index(1)
        for _ in range(4):
            assert _complete(proxy_console.url, proxy_console.auth, model="gamma", max_tokens=1).status_code == 200
        after = counts()
        assert in_flight() == [1 - busy, busy]  # the stream was still running throughout
    assert after[busy] == before[busy] + 1 and after[1 - busy] == before[1 - busy] + 4, (before, after)

    two.proc.kill()
    two.proc.wait()
    before = backends.log(one).count('"POST /v1/completions HTTP/1.1" 200')
    for _ in range(6):
        r = _complete(proxy_console.url, proxy_console.auth, model="gamma", max_tokens=1)
        assert r.status_code == 200, r.text
    assert backends.log(one).count('"POST /v1/completions HTTP/1.1" 200') == before + 6

    one.proc.kill()
    one.proc.wait()
    r = _complete(proxy_console.url, proxy_console.auth, model="gamma", max_tokens=1)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unreachable"
    assert r.json()["error"]["type"] == "upstream_error"


def test_ready_changes_and_stale_nodes_show_within_a_second(proxy_console, two_llms):
    alpha, _ = two_llms
    proxy_console.set_instances([{"name": "alpha", "port": alpha.port, "state": "LOADING"}])
    assert proxy_console.wait_models(set())["data"] == []
    r = _complete(proxy_console.url, proxy_console.auth, model="alpha")
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_backend"  # known, not ready yet

    proxy_console.set_instances([{"name": "alpha", "port": alpha.port}])
    assert [m["id"] for m in proxy_console.wait_models({"alpha"})["data"]] == ["alpha"]
    assert _complete(proxy_console.url, proxy_console.auth, model="alpha").status_code == 200

    proxy_console.set_instances([{"name": "alpha", "port": alpha.port}], node_fresh=False)
    assert proxy_console.wait_models(set())["data"] == []  # the node went stale: not routed to


def test_without_a_model_the_path_type_decides(proxy_console, two_llms, backends):
    alpha, _ = two_llms
    embed = backends.start("embed", embedding=True)
    proxy_console.set_instances([{"name": "alpha", "port": alpha.port},
                                 {"name": "embed", "port": embed.port, "type": "embedding"}])
    proxy_console.wait_models({"alpha", "embed"})
    r = httpx.post(f"{proxy_console.url}/v1/embeddings", headers=proxy_console.auth, json={"input": "x"}, timeout=30)
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64
    r = _complete(proxy_console.url, proxy_console.auth)
    assert r.json()["choices"][0]["text"] == _complete(alpha.base_url).json()["choices"][0]["text"]
    only = httpx.get(f"{proxy_console.url}/api/inference/embedding/v1/models", headers=proxy_console.auth).json()
    assert [m["id"] for m in only["data"]] == ["embed"]

    proxy_console.set_instances([{"name": "embed", "port": embed.port, "type": "embedding"}])
    proxy_console.wait_models({"embed"})
    r = _complete(proxy_console.url, proxy_console.auth)
    assert r.status_code == 503
    assert r.json() == {"error": {"message": "No llm model is ready.", "type": "service_unavailable",
                                  "code": "no_backend"}}


def test_a_backend_restarted_on_the_same_port_is_used_again(proxy_console, backends):
    first = backends.start("phoenix")
    proxy_console.set_instances([{"name": "phoenix", "port": first.port}])
    proxy_console.wait_models({"phoenix"})
    assert _complete(proxy_console.url, proxy_console.auth, model="phoenix", max_tokens=1).status_code == 200
    first.proc.kill()
    first.proc.wait()
    down = _complete(proxy_console.url, proxy_console.auth, model="phoenix", max_tokens=1)
    assert down.status_code == 502 and down.json()["error"]["code"] == "upstream_unreachable"
    again = backends.start("phoenix", port=first.port)  # the proxy's pooled connection is stale now
    assert again.port == first.port
    assert _complete(proxy_console.url, proxy_console.auth, model="phoenix", max_tokens=1).status_code == 200
