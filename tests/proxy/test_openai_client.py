"""The official `openai` client against a real console, backed by real llama.cpp servers: the
chat, streamed chat, completions and embeddings of each engine (llama-cpp-python, llama-server)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from tests.conftest import ENGINES
from tests.procs import stop_process
from tests.proxy.conftest import ProxyConsole


@dataclass
class Served(ProxyConsole):
    engine: str = ""


@pytest.fixture(scope="module", params=ENGINES)
def served(request, proxy_console, backends):
    engine = request.param
    chat = backends.start("tiny-chat", engine=engine)
    embed = backends.start("tiny-embed", embedding=True, engine=engine)
    proxy_console.set_instances([
        {"name": "tiny-chat", "port": chat.port, "backend": engine},
        {"name": "tiny-embed", "port": embed.port, "type": "embedding", "backend": engine},
    ])
    proxy_console.wait_models({"tiny-chat", "tiny-embed"})
    # The previous engine's rows had the same names: wait until the table shows this engine's.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            m["backend"] != engine for m in httpx.get(f"{proxy_console.url}/v1/models",
                                                      headers=proxy_console.auth).json()["data"]):
        time.sleep(0.1)
    yield Served(console=proxy_console.console, key=proxy_console.key, engine=engine)
    for server in (chat, embed):  # the next engine's servers take over the names
        stop_process(server.proc)


def _client(console, base: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=console.url + base, api_key=console.key, max_retries=0, timeout=60)


@pytest.mark.parametrize("base", ["/v1", "/api/inference/v1"])
def test_models_list(served, base):
    models = {m.id: m for m in _client(served, base).models.list()}
    assert set(models) == {"tiny-chat", "tiny-embed"}
    chat = models["tiny-chat"].model_dump()
    assert chat["object"] == "model" and chat["owned_by"] == "xgen" and chat["created"] > 0
    assert chat["type"] == "llm" and chat["backend"] == served.engine and chat["node"] == "gpu-b"
    assert models["tiny-embed"].model_dump()["type"] == "embedding"


def test_chat(served):
    answer = _client(served).chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0,
    )
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].message.content
    assert answer.usage.completion_tokens == 8


def test_streaming_chat(served):
    stream = _client(served).chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hello"}], max_tokens=16, temperature=0,
        stream=True,
    )
    chunks = list(stream)
    # One chunk per token, except that llama-server holds back the bytes of an unfinished UTF-8
    # character (the tiny model's byte tokens) and sends them with the next token.
    assert len(chunks) >= (16 if served.engine == "llama-cpp-python" else 8)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions(served):
    answer = _client(served).completions.create(model="tiny-chat", prompt="once upon", max_tokens=5)
    assert answer.object == "text_completion" and answer.usage.completion_tokens == 5


@pytest.mark.parametrize("base", ["/v1", "/api/inference/v1", "/api/inference/embedding/v1"])
def test_embeddings(served, base):
    answer = _client(served, base).embeddings.create(model="tiny-embed", input=["a cat", "a dog"])
    assert len(answer.data) == 2 and len(answer.data[0].embedding) == 64
    assert answer.usage.prompt_tokens > 0


def test_embeddings_without_a_model_go_to_the_embedding_backend(served):
    import httpx

    r = httpx.post(f"{served.url}/api/inference/embedding/v1/embeddings", headers=served.auth,
                   json={"input": "a cat"}, timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["data"][0]["embedding"]) == 64
    r = httpx.post(f"{served.url}/v1/chat/completions", headers=served.auth,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


def test_a_bad_key_is_refused_in_openai_shape(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="xgen_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.models.list()
    assert caught.value.status_code == 401
    assert caught.value.body == {"message": "Invalid API key.", "type": "authentication_error",
                                 "code": "invalid_api_key"}
