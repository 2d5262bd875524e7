"""Prefix-aware routing (issue 25 #2): the routing key a request is read to, and the replica order
the routing table gives for it (rendezvous hashing with bounded load). The real-engine check (two
llama-server replicas, long system prompts, the prompt cache hit) is in tests/faults/test_replicas.py;
the TTFT gain is measured in bench/prefix_routing.py."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from serving.proxy.prefix import routing_key
from serving.proxy.replicas import Backend, RoutingTable

SYSTEM = "You are the support assistant of ACME. " * 20  # 780 characters


@pytest.fixture(autouse=True)
def _prefix_routing(settings):
    settings.ROUTING = "prefix"  # least_inflight is the default (bench/prefix_routing.py)


def _chat(system: str, *turns: str) -> dict:
    messages = [{"role": "system", "content": system}]
    for i, turn in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": turn})
    return {"model": "m", "messages": messages}


def test_requests_that_start_alike_share_a_key_and_others_do_not():
    a = routing_key(_chat(SYSTEM, "Where is my order?"), 256)
    b = routing_key(_chat(SYSTEM, "Reset my password", "Done.", "Thanks"), 256)
    assert a == b and len(a) == 256  # the system prompt fills the key: every conversation under it
    assert routing_key(_chat(SYSTEM.replace("ACME", "Initech"), "Where is my order?"), 256) != a
    # A short system prompt: the first turns make the key, so one conversation keeps its replica.
    first = routing_key(_chat("Be brief.", "Tell me about Rome"), 256)
    later = routing_key(_chat("Be brief.", "Tell me about Rome", "Rome is ...", "And Paris?"), 256)
    other = routing_key(_chat("Be brief.", "Tell me about Oslo"), 256)
    assert first != other and later.startswith(first)
    assert routing_key(_chat("Be brief.", "Tell me about Rome" * 40), 64) == routing_key(
        _chat("Be brief.", "Tell me about Rome" * 40, "x", "y"), 64)


def test_every_api_shape_gives_its_key_and_what_has_none_gives_none():
    text = [{"type": "text", "text": SYSTEM}, {"type": "image_url", "image_url": {"url": "data:..."}}]
    assert routing_key({"messages": [{"role": "user", "content": text}]}, 100) == routing_key(
        {"messages": [{"role": "user", "content": SYSTEM}]}, 100)
    anthropic = routing_key({"system": SYSTEM, "messages": [{"role": "user", "content": "hi"}]}, 100)
    assert anthropic is not None and anthropic.startswith(b"system\x1fYou are the support")
    assert routing_key({"prompt": SYSTEM + "1"}, 100) == routing_key({"prompt": SYSTEM + "2"}, 100) == SYSTEM[:100].encode()
    assert routing_key({"prompt": [SYSTEM, "other"]}, 100) == SYSTEM[:100].encode()
    assert routing_key({"prompt": [[1, 2, 3], [4]]}, 100) == b"1,2,3" == routing_key({"prompt": [1, 2, 3]}, 100)
    for payload in ({"input": "embed me"}, {"prompt": ""}, {"messages": []}, {}, {"messages": "x"},
                    {"messages": [None, 3, {"role": 7, "content": {"a": 1}}]}, {"prompt": {"x": 1}},
                    {"messages": [{"role": "user", "content": [None, {"type": None}]}]}):
        key = routing_key(payload, 100)
        assert key is None or isinstance(key, bytes), payload
    assert routing_key({"messages": [{"role": "user", "content": ""}]}, 100) == b"user\x1f\x1e"  # a role is a start
    assert routing_key({"prompt": "\ud800 lone surrogate"}, 100)  # never raises on strange text
    huge = {"messages": [{"role": "user", "content": "x"}] * 1_000_000}
    assert len(routing_key(huge, 1_000_000)) == 256 * len(b"user\x1fx\x1e")  # MAX_PARTS messages are read


def _backends(n: int, start: int = 1) -> list[Backend]:
    return [Backend(instance_id=i, model_name="m", type="llm", backend="llama-server", node="n",
                    base_url=f"http://127.0.0.1:{18000 + i}", created=0) for i in range(start, start + n)]


def _first(table: RoutingTable, backends: list[Backend], key: bytes | None) -> int:
    return table.order(backends, key)[0].instance_id


def test_one_key_one_replica_in_every_process_and_keys_spread_evenly():
    backends = _backends(3)
    keys = [f"conversation {i}".encode() for i in range(3000)]
    one, two = RoutingTable(), RoutingTable()  # two web processes: the same choice, whatever they served
    firsts = [_first(one, backends, k) for k in keys]
    assert firsts == [_first(two, list(reversed(backends)), k) for k in keys]
    assert firsts == [_first(one, backends, k) for k in keys]  # and the same every time
    shares = Counter(firsts)
    assert set(shares) == {1, 2, 3} and all(800 <= n <= 1200 for n in shares.values()), shares


def test_a_replica_that_goes_moves_only_its_own_keys_and_one_that_comes_takes_a_share():
    table = RoutingTable()
    keys = [f"k{i}".encode() for i in range(2000)]
    three = {k: _first(table, _backends(3), k) for k in keys}
    two = {k: _first(table, _backends(2), k) for k in keys}  # replica 3 gone
    assert all(two[k] == three[k] for k in keys if three[k] != 3)
    four = {k: _first(table, _backends(4), k) for k in keys}  # replica 4 came
    moved = [k for k in keys if four[k] != three[k]]
    assert all(four[k] == 4 for k in moved) and 350 <= len(moved) <= 650, len(moved)


def test_a_busy_replica_is_passed_over_within_the_bound_and_a_down_one_always(settings):
    settings.ROUTING_PREFIX_EPS = 0.25
    table = RoutingTable()
    backends = _backends(2)
    key = b"hot system prompt"
    home = table.order(backends, key)[0]
    other = next(b for b in backends if b is not home)
    # A replica is chosen while it holds fewer than ceil(1.25 x the mean in flight, this request counted).
    home.in_flight, other.in_flight = 3, 1
    assert table.order(backends, key)[0] is home  # cap ceil(1.25 x 5 / 2) = 4 > 3
    home.in_flight = 4
    assert table.order(backends, key)[0] is other  # cap ceil(1.25 x 6 / 2) = 4: home is full
    assert table.order(backends, key)[1] is home  # next, should the other refuse the connection
    home.in_flight = other.in_flight = 0
    home.mark_down()
    assert [b.instance_id for b in table.order(backends, key)] == [other.instance_id, home.instance_id]


def test_least_inflight_ignores_the_key_and_no_key_rotates(settings):
    backends = _backends(2)
    table = RoutingTable()
    settings.ROUTING = "least_inflight"
    assert Counter(_first(table, backends, b"same") for _ in range(10)) == {1: 5, 2: 5}
    settings.ROUTING = "prefix"
    assert len({_first(table, backends, b"same") for _ in range(10)}) == 1
    assert Counter(_first(table, backends, None) for _ in range(10)) == {1: 5, 2: 5}


@pytest.mark.parametrize("n", [2, 5])
def test_random_keys_under_concurrency_never_exceed_the_bound(settings, n):
    """64 requests in flight at once over random keys (some hot): no replica holds more than the cap
    it was chosen under."""
    settings.ROUTING_PREFIX_EPS = 0.25
    table, backends, rng = RoutingTable(), _backends(n), random.Random(7)
    for _ in range(64):
        key = b"hot" if rng.random() < 0.7 else str(rng.random()).encode()
        total = sum(b.in_flight for b in backends) + 1
        cap = -(-5 * total // (4 * n))  # ceil(1.25 x total / n)
        chosen = table.order(backends, key)[0]
        assert chosen.in_flight < cap
        chosen.in_flight += 1
    assert max(b.in_flight for b in backends) - min(b.in_flight for b in backends) <= -(-64 // n)
