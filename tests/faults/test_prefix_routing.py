"""Prefix-aware routing on real engines (issue 25 #2): one real console (`manage.py serve`,
XGEN_ROUTING=prefix) with two llama-server replicas of the tiny model. Four long system
prompts, short user turns from two clients at once (within the load bound, whichever way the four
prompts hash): each prompt's requests land on one replica
(the request log says which), and there llama-server's prompt cache holds the system prompt: the
answers' `timings.cache_n` count it as reused. The TTFT it saves is measured in bench/prefix_routing.py."""
from __future__ import annotations

import concurrent.futures
import time
from collections import Counter, defaultdict
from collections.abc import Iterator

import httpx
import pytest

from tests.faults.conftest import FaultConsole, backends_console

PROMPTS = 4
PER_PROMPT = 10


@pytest.fixture(scope="module")
def console(tmp_path_factory) -> Iterator[FaultConsole]:
    yield from backends_console(tmp_path_factory.mktemp("prefix"), extra_env={"XGEN_ROUTING": "prefix"})


def _system(n: int) -> str:
    # ~1,500 tokens of the tiny model's vocabulary each, different from the first words on.
    return f"Policy {n}: " + " ".join(f"rule {n}-{i} applies to case {i * 7 + n}." for i in range(58))


def _wait_ready(c: FaultConsole, model: str, n: int, timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(f"{c.url}/api/management/instances", headers=c.auth, timeout=10)
        rows = [i for i in r.json() if i["model_name"] == model and i["desired_state"] != "STOPPED"]
        if len(rows) == n and all(i["state"] == "READY" for i in rows):
            return rows
        assert not any(i["state"] == "ERROR" for i in rows), rows
        time.sleep(0.2)
    raise AssertionError(f"{model}: never {n} READY")


def test_each_system_prompt_stays_on_one_replica_where_its_prompt_is_cached(console, tiny_gguf):
    c = console
    r = c.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "sticky",
                                        "backend": "llama-server", "replicas": 2,
                                        "extra_args": {"--ctx-size": 16384, "--parallel": 4, "--threads": 1}})
    assert r.status_code == 202, r.text
    replicas = {i["id"] for i in _wait_ready(c, "sticky", 2)}

    def ask(job: tuple[int, int]) -> tuple[int, int, int]:
        prompt, turn = job
        r = httpx.post(f"{c.url}/v1/chat/completions", timeout=120,
                       headers={**c.auth, "X-Request-ID": f"sticky-{prompt}-{turn}"},
                       json={"model": "sticky", "max_tokens": 2, "temperature": 0, "messages": [
                           {"role": "system", "content": _system(prompt)},
                           {"role": "user", "content": f"question {turn}"}]})
        assert r.status_code == 200, r.text
        timings = r.json().get("timings") or {}
        return prompt, timings.get("cache_n", 0), timings.get("prompt_n", 0)

    jobs = [(p, t) for t in range(PER_PROMPT) for p in range(PROMPTS)]  # the prompts interleaved
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(ask, jobs))

    deadline = time.monotonic() + 30
    while True:
        rows = httpx.get(f"{c.url}/api/requests", params={"model": "sticky", "limit": 1000}, headers=c.auth,
                         timeout=10).json()["items"]
        if len(rows) >= len(jobs) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    by_prompt: dict[int, Counter] = defaultdict(Counter)
    for row in rows:
        prompt = int(row["client_request_id"].split("-")[1])
        by_prompt[prompt][row["instance_id"]] += 1
    assert sorted(by_prompt) == list(range(PROMPTS)) and sum(map(sum, map(Counter.values, by_prompt.values()))) == len(jobs)
    for prompt, served in by_prompt.items():
        assert set(served) <= replicas
        assert max(served.values()) >= 0.95 * PER_PROMPT, (prompt, served)  # >= 95 % on one replica
    # A real cache hit: after each prompt's first request, llama-server reused the system prompt.
    hits = [cache_n for _, cache_n, _ in answers[PROMPTS:]]
    assert sum(1 for n in hits if n >= 1000) >= 0.9 * len(hits), answers
    firsts = [prompt_n for _, _, prompt_n in answers[:PROMPTS]]
    assert all(n >= 1000 for n in firsts), answers  # the first of each computed its whole prompt
