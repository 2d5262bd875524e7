"""Issue 15: the whole API clients expect. Any POST /v1/<path> naming a model is forwarded, engine
routes as /api/inference/<route>, Server-Timing on every answer, and Anthropic's Messages API with
the official `anthropic` SDK (native on llama-server, translated on llama-cpp-python), against a
real console and real engines; a stand-in backend answers tool calls the random model cannot."""
from __future__ import annotations

import json
import re

import anthropic
import httpx
import openai
import pytest

from tests.procs import stop_process
from tests.proxy.conftest import AiohttpBackend

TIMING_RE = re.compile(r"^proxy;dur=(\d+\.\d), upstream;dur=(\d+\.\d)$")


class ToolBackend(AiohttpBackend):
    """Answers /v1/chat/completions like an engine whose model calls a tool (or, after a tool
    result, says the answer), JSON or streamed; keeps every request body. Other paths: aiohttp's
    plain-text 404."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        super().__init__()

    def add_routes(self, app) -> None:
        from aiohttp import web

        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.seen.append(body)
            answered = any(m["role"] == "tool" for m in body["messages"])
            usage = {"prompt_tokens": 21, "completion_tokens": 5, "total_tokens": 26}
            call = {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
            if not body.get("stream"):
                message = ({"role": "assistant", "content": "It is sunny."} if answered
                           else {"role": "assistant", "content": None, "tool_calls": [call]})
                return web.json_response({
                    "id": "chatcmpl-abc", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "message": message,
                                 "finish_reason": "stop" if answered else "tool_calls"}], "usage": usage})
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)

            async def event(delta: dict, finish: str | None = None) -> None:
                chunk = {"id": "chatcmpl-abc", "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

            await event({"role": "assistant", "content": "Let me check."})
            await event({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                         "function": {"name": "get_weather", "arguments": ""}}]})
            await event({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]})
            await event({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, "tool_calls")
            final = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "choices": [], "usage": usage}
            await response.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
            await response.write_eof()
            return response

        app.router.add_post("/v1/chat/completions", chat)


@pytest.fixture(scope="module", params=["daphne", "uvicorn"])
def api(request, backends):
    proxy_console = request.getfixturevalue("proxy_console_daphne" if request.param == "daphne" else "proxy_console")
    native = backends.start("ls-chat", engine="llama-server")
    translated = backends.start("lcp-chat", engine="llama-cpp-python")
    tools = ToolBackend()
    proxy_console.set_instances([
        {"name": "ls-chat", "port": native.port, "backend": "llama-server"},
        {"name": "lcp-chat", "port": translated.port, "backend": "llama-cpp-python", "aliases": ["lcp-alias"]},
        {"name": "tool-bot", "port": tools.port, "backend": "llama-cpp-python", "aliases": ["tb-alias"]},
        {"name": "stub-embed", "port": tools.port, "backend": "llama-cpp-python", "type": "embedding"},
    ])
    proxy_console.wait_models({"ls-chat", "lcp-chat", "tool-bot", "stub-embed"})
    yield proxy_console, tools
    tools.stop()
    for server in (native, translated):
        stop_process(server.proc)


def _post(console, path: str, **kwargs) -> httpx.Response:
    return httpx.post(console.url + path, headers={**console.auth, **kwargs.pop("headers", {})}, timeout=60, **kwargs)


def _anthropic(console, key: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=console.url, api_key=key or console.key, max_retries=0, timeout=60)


# ---------------------------------------------------------------- 1. every route
@pytest.mark.parametrize("route,body,field", [
    ("tokenize", {"content": "hello world"}, "tokens"),
    ("apply-template", {"messages": [{"role": "user", "content": "hi"}]}, "prompt"),
])
def test_engine_routes_reach_llama_server(api, route, body, field):
    console, _ = api
    r = _post(console, f"/api/inference/{route}", json={"model": "ls-chat", **body})
    assert r.status_code == 200, r.text
    assert field in r.json()
    if route == "tokenize":
        tokens = r.json()["tokens"]
        back = _post(console, "/api/inference/detokenize", json={"model": "ls-chat", "tokens": tokens})
        assert back.status_code == 200 and "hello world" in back.json()["content"], back.text


def test_a_route_the_backend_lacks_is_404_in_openai_shape(api):
    """Each engine gets only its own inference routes (issue 34 #8): a route it lacks is refused
    by the console, and a route no engine serves is unknown."""
    console, _ = api
    for model in ("lcp-chat", "tool-bot"):  # both llama-cpp-python: no /tokenize
        r = _post(console, "/api/inference/tokenize", json={"model": model, "content": "x"})
        assert r.status_code == 404, r.text
        assert set(r.json()["error"]) == {"message", "type", "code"}
        assert r.json()["error"]["code"] == "unsupported_by_backend" and "llama-cpp-python" in r.text
    client = openai.OpenAI(base_url=console.url + "/v1", api_key=console.key, max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as caught:
        client.images.generate(model="lcp-chat", prompt="a cat")
    assert caught.value.body["code"] == "not_found"
    with pytest.raises(openai.NotFoundError) as caught:
        client.audio.transcriptions.create(model="tool-bot", file=("a.wav", b"RIFF0000WAVE", "audio/wav"))
    assert caught.value.body["code"] == "unsupported_by_backend"


def test_responses_on_llama_server_with_the_openai_sdk(api):
    console, _ = api
    client = openai.OpenAI(base_url=console.url + "/v1", api_key=console.key, max_retries=0, timeout=60)
    answer = client.responses.create(model="ls-chat", input="hello", max_output_tokens=8, temperature=0)
    assert answer.object == "response" and answer.output
    assert answer.usage.output_tokens > 0


def test_responses_elsewhere_is_unsupported_by_backend(api):
    console, _ = api
    r = _post(console, "/v1/responses", json={"model": "lcp-chat", "input": "hello"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "unsupported_by_backend" and "llama-cpp-python" in r.json()["error"]["message"]


def test_type_rules_hold_for_named_models(api):
    console, _ = api
    r = _post(console, "/v1/chat/completions", json={"model": "stub-embed", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_type_mismatch", r.text
    r = _post(console, "/v1/embeddings", json={"model": "lcp-chat", "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_type_mismatch", r.text
    r = _post(console, "/v1/messages", json={"model": "stub-embed", "max_tokens": 1, "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text


def test_unknown_paths_are_still_404(api):
    console, _ = api
    assert _post(console, "/api/inference/../v1/chat", json={}).status_code == 404
    assert _post(console, "/api/inference/props", json={"model": "ls-chat"}).status_code == 404
    assert _post(console, "/api/inference/embedding/v1/chat/completions", json={}).status_code == 404
    r = httpx.get(console.url + "/v1/responses", headers=console.auth)
    assert r.status_code == 405


# ---------------------------------------------------------------- 2. timing
def test_server_timing_on_every_answer_and_in_metrics(api):
    console, _ = api
    r = _post(console, "/v1/chat/completions", json={"model": "lcp-chat", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    proxy_ms, upstream_ms = map(float, TIMING_RE.match(r.headers["server-timing"]).groups())
    assert upstream_ms > proxy_ms >= 0  # generating takes longer than the console's own work
    with httpx.stream("POST", console.url + "/v1/completions", headers=console.auth, timeout=60,
                      json={"model": "ls-chat", "prompt": "a", "max_tokens": 3, "stream": True}) as streamed:
        assert TIMING_RE.match(streamed.headers["server-timing"]), streamed.headers
    refused = _post(console, "/v1/chat/completions", json={"model": "nope"})
    assert refused.status_code == 404 and refused.headers["server-timing"].startswith("proxy;dur=")
    metrics = httpx.get(console.url + "/metrics", headers=console.auth).text
    assert 'xgen_inference_proxy_seconds_count{instance="' in metrics
    assert 'xgen_inference_upstream_seconds_count{instance="' in metrics


# ---------------------------------------------------------------- 3. Anthropic Messages
@pytest.mark.parametrize("model", ["ls-chat", "lcp-chat"])  # native, translated
def test_messages_with_the_anthropic_sdk(api, model):
    console, _ = api
    client = _anthropic(console)
    message = client.messages.create(model=model, max_tokens=8, system="Be brief.",
                                      messages=[{"role": "user", "content": "hello"}])
    assert message.type == "message" and message.role == "assistant"
    assert message.content and message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8
    assert message.usage.input_tokens > 0

    # Greedy: the random tiny model's sampled bytes otherwise vary from run to run.
    with client.messages.stream(model=model, max_tokens=6, extra_body={"temperature": 0, "top_k": 1},
                                messages=[{"role": "user", "content": "hello"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and "content_block_delta" in kinds and "message_stop" in kinds
    assert final.content[0].text and final.stop_reason == "max_tokens"

    count = client.messages.count_tokens(model=model, system="Be brief.",
                                         messages=[{"role": "user", "content": "hello"}])
    assert count.input_tokens > 0


def test_messages_auth_and_errors_in_anthropic_shape(api):
    console, _ = api
    with pytest.raises(anthropic.AuthenticationError) as caught:
        _anthropic(console, key="xgen_wrong").messages.create(
            model="lcp-chat", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": "Invalid API key."}}
    with pytest.raises(anthropic.NotFoundError) as caught:
        _anthropic(console).messages.create(model="nope", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(console.url + "/v1/messages/count_tokens", content=b"{", timeout=30,
                   headers={"x-api-key": console.key, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.post(console.url + "/v1/messages", json={"model": "lcp-chat", "messages": "no"}, timeout=30,
                   headers={"x-api-key": console.key})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text


TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def test_tool_use_round_trip_on_the_translated_path(api):
    console, tools = api
    client = _anthropic(console)
    tools.seen.clear()
    first = client.messages.create(model="tool-bot", max_tokens=64, system="You check the weather.", tools=TOOLS,
                                   tool_choice={"type": "auto"},
                                   messages=[{"role": "user", "content": "Weather in Paris?"}])
    sent = tools.seen[-1]
    assert sent["messages"][0] == {"role": "system", "content": "You check the weather."}
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city", "parameters": TOOLS[0]["input_schema"]}}]
    assert sent["tool_choice"] == "auto" and sent["max_tokens"] == 64
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id == "call_1" and first.usage.input_tokens == 21

    second = client.messages.create(model="tool-bot", max_tokens=64, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [c.model_dump() for c in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 24 C"}]},
    ])
    sent = tools.seen[-1]["messages"]
    assert sent[1] == {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert sent[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}
    assert second.stop_reason == "end_turn" and second.content[0].text == "It is sunny."

    with client.messages.stream(model="tool-bot", max_tokens=64, tools=TOOLS,
                                messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        final = stream.get_final_message()
    assert [c.type for c in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Let me check." and final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 5


# ---------------------------------------------------------------- 4. aliases
def test_an_alias_routes_like_the_served_name(api):
    console, tools = api
    listing = httpx.get(console.url + "/v1/models", headers=console.auth).json()
    entry = next(m for m in listing["data"] if m["id"] == "lcp-chat")
    assert entry["aliases"] == ["lcp-alias"] and "lcp-alias" not in {m["id"] for m in listing["data"]}
    assert httpx.get(console.url + "/v1/models/lcp-alias", headers=console.auth).json()["id"] == "lcp-chat"
    r = _post(console, "/v1/chat/completions", json={"model": "lcp-alias", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    r = _post(console, "/v1/chat/completions", json={"model": "tb-alias", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and tools.seen[-1]["model"] == "tool-bot"  # the backend sees the served name
    message = _anthropic(console).messages.create(model="lcp-alias", max_tokens=2,
                                                  messages=[{"role": "user", "content": "hi"}])
    assert message.usage.output_tokens == 2


# ---------------------------------------------------------------- the auth matrix of the proxy's routes
def test_every_proxy_route_needs_a_key(api):
    from tests.security.routes import PROXY_ROUTES

    console, _ = api
    for method, path, role in PROXY_ROUTES:
        assert role == "viewer"  # inference is open to every role (api.md)
        for label, headers in (("anonymous", {}), ("bad key", {"authorization": "Bearer xgen_bogus"}),
                               ("bad x-api-key", {"x-api-key": "xgen_bogus"})):
            r = httpx.request(method, console.url + path, headers=headers, json={"model": "lcp-chat"}, timeout=30)
            assert r.status_code == 401, (method, path, label, r.status_code)
            body = r.json()
            assert (body["error"]["type"] == "authentication_error" if "/v1/messages" in path
                    else set(body["error"]) == {"message", "type", "code"}), (path, body)
        for headers in ({"authorization": f"Bearer {console.key}"}, {"x-api-key": console.key}):
            r = httpx.request(method, console.url + path, headers=headers, json={"model": "lcp-chat"}, timeout=60)
            assert r.status_code not in (401, 403) and r.status_code < 500, (method, path, r.status_code, r.text[:300])


def test_langchain_openai_chat_against_the_console(api):
    from langchain_openai import ChatOpenAI

    console, _ = api
    # (LangChain sends max_completion_tokens, which llama-cpp-python does not read: max_tokens as is.)
    llm = ChatOpenAI(base_url=console.url + "/v1", api_key=console.key, model="lcp-chat", temperature=0,
                     extra_body={"max_tokens": 4}, max_retries=0, timeout=60)
    answer = llm.invoke("hello")
    assert answer.content and answer.usage_metadata["output_tokens"] == 4
    chunks = list(llm.stream("hello"))
    assert "".join(c.content for c in chunks)
