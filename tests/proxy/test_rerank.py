"""Rerank through the console (issue 15): a real llama-server started with `--reranking` on the
tiny reranker GGUF the tests write, and a real llama-server LLM beside it, behind a real console.
/v1/rerank (and /api/inference/rerank) answer the backend's own ranking; the type rules hold both
ways: no chat, completions or embeddings to the reranker, no rerank or score to an LLM or an
embedding model (400 `model_type_mismatch`)."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.procs import stop_process

QUERY = {"query": "hello world", "documents": ["the GPU", "hello world", "water", "a long day"]}


@pytest.fixture(scope="module")
def fleet(proxy_console, backends, tiny_reranker):
    reranker = backends.start("tiny-rr", engine="llama-server", model=tiny_reranker, rerank=True)
    llm = backends.start("ls-chat", engine="llama-server")
    proxy_console.set_instances([
        {"name": "tiny-rr", "port": reranker.port, "backend": "llama-server", "type": "rerank"},
        {"name": "ls-chat", "port": llm.port, "backend": "llama-server"},
        # Never reached: the type check refuses before forwarding.
        {"name": "stub-embed", "port": llm.port, "backend": "llama-server", "type": "embedding"},
    ])
    proxy_console.wait_models({"tiny-rr", "ls-chat", "stub-embed"})
    yield proxy_console, reranker
    for server in (reranker, llm):
        stop_process(server.proc)


def _post(console, path: str, body: dict) -> httpx.Response:
    return httpx.post(console.url + path, headers=console.auth, json=body, timeout=60)


@pytest.mark.parametrize("path", ["/v1/rerank", "/api/inference/rerank", "/v1/reranking"])
def test_rerank_through_the_console_is_the_backends_own_answer(fleet, path):
    console, reranker = fleet
    body = {"model": "tiny-rr", **QUERY, "top_n": 3}
    r = _post(console, path, body)
    assert r.status_code == 200, r.text
    direct = httpx.post(f"{reranker.base_url}/v1/rerank", json=body, timeout=60)
    assert r.json() == direct.json()  # forwarded as is, and the tiny model is deterministic
    answer = r.json()
    assert answer["model"] == "tiny-rr" and answer["object"] == "list"
    assert answer["usage"]["prompt_tokens"] > 0
    results = answer["results"]
    assert len(results) == 3 and set(results[0]) == {"index", "relevance_score"}
    assert len({row["index"] for row in results}) == 3 and all(0 <= row["index"] < 4 for row in results)
    scores = [row["relevance_score"] for row in results]
    assert scores == sorted(scores, reverse=True)
    assert r.headers["server-timing"].startswith("proxy;dur=")


def test_rerank_in_tei_shape_and_without_a_model(fleet):
    console, _ = fleet
    # TEI's shape (texts in, a bare list out) passes through like Jina's.
    r = _post(console, "/v1/rerank", {"model": "tiny-rr", "query": "hello", "texts": ["hello", "water"]})
    assert r.status_code == 200 and isinstance(r.json(), list) and {"index", "score"} <= set(r.json()[0]), r.text
    # No model named: the path's kind picks the rerank model.
    r = _post(console, "/v1/rerank", QUERY)
    assert r.status_code == 200 and len(r.json()["results"]) == 4, r.text


def test_the_usage_of_a_rerank_is_counted(fleet):
    console, _ = fleet
    r = _post(console, "/v1/rerank", {"model": "tiny-rr", **QUERY})
    assert r.status_code == 200
    request_id, tokens = r.headers["x-request-id"], r.json()["usage"]["prompt_tokens"]
    deadline = time.monotonic() + 30  # the request log is written in batches (XGEN_USAGE_FLUSH)
    while True:
        items = httpx.get(f"{console.url}/api/requests", params={"request_id": request_id},
                          headers=console.auth).json()["items"]
        if items or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert items and items[0]["model"] == "tiny-rr" and items[0]["status"] == 200
    assert items[0]["prompt_tokens"] == tokens


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/embeddings", {"input": "hi"}),
    ("/v1/responses", {"input": "hi"}),
    ("/api/inference/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/api/inference/infill", {"input_prefix": "a", "input_suffix": "b"}),
])
def test_a_rerank_model_takes_no_generation_or_embeddings(fleet, path, body):
    console, _ = fleet
    r = _post(console, path, {"model": "tiny-rr", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "model_type_mismatch" and set(error) == {"message", "type", "code"}
    assert "tiny-rr" in error["message"] and "rerank model" in error["message"]


def test_anthropic_messages_to_a_reranker_are_refused_in_anthropics_shape(fleet):
    console, _ = fleet
    r = _post(console, "/v1/messages", {"model": "tiny-rr", "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "rerank model" in r.json()["error"]["message"]


@pytest.mark.parametrize("model,kind", [("ls-chat", "llm"), ("stub-embed", "embedding")])
@pytest.mark.parametrize("path", ["/v1/rerank", "/v1/reranking", "/v1/score", "/api/inference/rerank",
                                  "/api/inference/score"])
def test_rerank_and_score_go_to_rerank_models_only(fleet, model, kind, path):
    console, _ = fleet
    r = _post(console, path, {"model": model, **QUERY, "text_1": "a", "text_2": "b"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "model_type_mismatch"
    assert f"is a{'n' if kind[0] in 'aeiou' else ''} {kind} model" in error["message"]
    assert "needs a rerank model" in error["message"]


def test_the_llm_still_chats_beside_the_reranker(fleet):
    console, _ = fleet
    r = _post(console, "/v1/chat/completions", {"model": "ls-chat", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["choices"], r.text
    r = _post(console, "/v1/chat/completions", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["model"] == "ls-chat", r.text  # no model: an LLM, never the reranker
    listing = httpx.get(f"{console.url}/v1/models", headers=console.auth).json()["data"]
    assert {m["id"]: m["type"] for m in listing}["tiny-rr"] == "rerank"


# ---------------------------------------------------------------- the Ninja routes (Django reached directly)
@pytest.fixture
def typed_rows(transactional_db):
    from django.utils import timezone

    from hardware.models import Node
    from serving.models import ModelInstance
    from serving.proxy.replicas import routing_table

    node = Node.objects.create(name="gpu-local", address="127.0.0.1", last_heartbeat=timezone.now())
    for name, kind in (("rr", "rerank"), ("chat", "llm")):  # port 9: the refusal comes before any forwarding
        ModelInstance.objects.create(model_name=name, model_path="/m", backend="llama-server", node=node, port=9,
                                     type=kind, state="READY", ready_at=timezone.now())
    routing_table.invalidate()


async def test_the_ninja_routes_hold_the_type_rules(typed_rows, viewer):
    from django.test import AsyncClient

    from serving.proxy.upstream import shutdown_proxy

    client = AsyncClient()
    auth = {"authorization": f"Bearer {viewer.key}"}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    try:
        for path, body in (("/api/inference/v1/chat/completions", {"model": "rr", **chat}),
                           ("/api/inference/v1/completions", {"model": "rr", "prompt": "hi"}),
                           ("/api/inference/v1/embeddings", {"model": "rr", "input": "hi"}),
                           ("/api/inference/v1/rerank", {"model": "chat", **QUERY}),
                           ("/api/inference/v1/score", {"model": "chat", "text_1": "a", "text_2": "b"}),
                           ("/api/inference/rerank", {"model": "chat", **QUERY})):
            r = await client.post(path, data=body, content_type="application/json", headers=auth)
            content = b"".join([chunk async for chunk in r.streaming_content]) if r.streaming else r.content
            assert r.status_code == 400, (path, content)
            assert json.loads(content)["error"]["code"] == "model_type_mismatch", (path, content)
    finally:
        await shutdown_proxy()
