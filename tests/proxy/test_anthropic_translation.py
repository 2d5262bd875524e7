"""The Messages <-> chat-completions mapping on its own (no console, no engine), and which
backend serves which optional route (the adapters know)."""
from __future__ import annotations

import json

import pytest

from serving.adapters import get_adapter
from serving.proxy import anthropic
from serving.proxy.errors import ProxyError
from serving.proxy.relay import openai_error_for
from serving.proxy.routing import resolve_route


def test_which_backend_serves_which_optional_route():
    server, binding, vllm = get_adapter("llama-server"), get_adapter("llama-cpp-python"), get_adapter("vllm")
    for path in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
        assert server.serves(path) and not binding.serves(path)
    assert binding.serves("/v1/chat/completions") and not binding.serves("/v1/audio/speech")  # its allowlist
    assert vllm.serves("/v1/responses") and vllm.serves("/v1/responses", "0.10.1")
    assert not vllm.serves("/v1/responses", "0.9.2")
    assert not vllm.serves("/v1/messages") and vllm.serves("/v1/messages", "0.12.0")  # translated without a version


def test_routes():
    assert resolve_route("/v1/audio/transcriptions").upstream_path == "/v1/audio/transcriptions"
    assert resolve_route("/api/inference/v1/messages").kind == "llm"
    assert resolve_route("/api/inference/tokenize").upstream_path == "/tokenize"
    assert resolve_route("/api/inference/embedding/v1/embeddings").kind == "embedding"
    for bad in ("/tokenize", "/api/inference/props", "/v1/../x", "/v1/", "/api/inference/embedding/v1/messages"):
        with pytest.raises(ProxyError):
            resolve_route(bad)


def test_request_mapping():
    chat = anthropic.to_chat_request({
        "model": "m", "max_tokens": 9, "stop_sequences": ["END"], "stream": True, "top_k": 3,
        "system": [{"type": "text", "text": "sys"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "f"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAA"}}]},
            {"role": "assistant", "content": [{"type": "text", "text": "calling"},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                          "content": [{"type": "text", "text": "boom"}]}]},
        ]})
    assert chat["messages"][0] == {"role": "system", "content": "sys"}
    assert chat["messages"][1]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}
    assert chat["messages"][2]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "Error: boom"}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["stop"] == ["END"] and chat["top_k"] == 3 and chat["stream_options"] == {"include_usage": True}
    assert anthropic.to_chat_request({"model": "m", "max_tokens": 50, "messages": []}, count_only=True)["max_tokens"] == 1
    for bad in ({"messages": "no"}, {"messages": [{"role": "system", "content": "x"}]}, {"system": {"a": 1}},
                {"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, {"tools": ["x"]}):
        with pytest.raises(ProxyError) as caught:
            anthropic.Translation({"model": "m", "max_tokens": 1, **bad})
        assert caught.value.status == 400


def test_stream_mapping():
    t = anthropic.StreamTranslator("m")
    out = t.feed({"id": "chatcmpl-1", "choices": [{"delta": {"content": "Hi"}}]})
    out += t.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f",
                                                                                              "arguments": "{}"}}]},
                                "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})
    out += t.finish() + t.finish()
    events = [json.loads(e.split(b"data: ", 1)[1]) for e in out]
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["id"] == "msg_1" and events[4]["content_block"]["type"] == "tool_use"
    # the input in message_delta too: message_start went out before the backend's usage came (issue 32 #3)
    assert events[7]["delta"]["stop_reason"] == "tool_use" and events[7]["usage"] == {"input_tokens": 4,
                                                                                       "output_tokens": 2}


def test_error_shapes():
    assert json.loads(anthropic.error_bytes(429, "slow")) == {"type": "error", "error": {"type": "rate_limit_error",
                                                                                      "message": "slow"}}
    fixed = json.loads(anthropic.backend_error(400, b'{"error": {"message": "bad", "type": "x"}}', "application/json"))
    assert fixed["error"] == {"type": "invalid_request_error", "message": "bad"}
    assert anthropic.backend_error(400, b'{"type": "error", "error": {"type": "x", "message": "y"}}', "") is None
    assert openai_error_for(404, b'{"error": {"message": "m"}}', "application/json") is None
    assert json.loads(openai_error_for(404, b"<h1>Not Found</h1>", "text/html"))["error"] == {
        "message": "Not Found", "type": "not_found_error", "code": "not_found"}
    assert json.loads(openai_error_for(404, b'{"detail": "Not Found"}', "application/json"))["error"]["message"] == \
        "Not Found"
    assert anthropic.is_messages_path("/api/inference/v1/messages") and not anthropic.is_messages_path("/x/v1/messages")
    assert anthropic.with_api_key_auth({b"x-api-key": b"k"})[b"authorization"] == b"Bearer k"


@pytest.mark.django_db(transaction=True)
def test_the_documented_operations_answer_through_the_proxy(client, viewer):
    """Django reached directly (no ASGI proxy ahead of it): the Ninja operations answer as the proxy does."""
    from asgiref.sync import async_to_sync

    from tests.conftest import bearer

    async def collect(content) -> bytes:
        return b"".join([chunk async for chunk in content])

    def body(response) -> dict:  # an error comes as a whole response, an answer streamed
        return json.loads(async_to_sync(collect)(response.streaming_content) if response.streaming
                          else response.content)

    r = client.post("/api/inference/v1/messages", {"model": "nope", "max_tokens": 1, "messages": []},
                    content_type="application/json", **bearer(viewer.key))
    assert r.status_code == 404
    assert body(r) == {"type": "error", "error": {
        "type": "not_found_error", "message": "The model 'nope' does not exist or is not loaded."}}
    assert r["server-timing"].startswith("proxy;dur=")
    r = client.post("/api/inference/tokenize", {"model": "nope"}, content_type="application/json",
                    **bearer(viewer.key))
    assert r.status_code == 404 and body(r)["error"]["code"] == "model_not_found"
