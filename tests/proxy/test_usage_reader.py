"""The usage reader on answers recorded from the engines (llama-server and llama-cpp-python
0.3.36 on the tiny model; trimmed): every shape, streamed and not, and the shapes that hid
usage from the old 4 KiB tail scan (issue 34 A.1, A.2, A.6)."""
from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from serving.proxy.upstream import strip_usage_events
from serving.proxy.usage_reader import (
    StreamReader,
    count_request,
    counted,
    done_at,
    from_object,
    read_body,
    shape_of,
    sse_payloads,
)

CHAT = (b'{"choices":[{"finish_reason":"length","index":0,"message":{"role":"assistant","content":" first"}}],'
        b'"created":1796301829,"model":"tiny","object":"chat.completion","usage":{"completion_tokens":5,'
        b'"prompt_tokens":30,"total_tokens":35,"prompt_tokens_details":{"cached_tokens":0}},"id":"chatcmpl-9l",'
        b'"timings":{"cache_n":0,"prompt_n":30,"predicted_n":5}}')
MESSAGES = (b'{"id":"chatcmpl-St","type":"message","role":"assistant","content":[{"type":"text","text":"s then"}],'
            b'"model":"tiny","stop_reason":"max_tokens","stop_sequence":null,'
            b'"usage":{"cache_read_input_tokens":29,"input_tokens":1,"output_tokens":3}}')
RESPONSES = (b'{"completed_at":1796301863,"id":"resp_H6","model":"tiny","object":"response","output":[{"content":'
             b'[{"type":"output_text","text":"x"}],"role":"assistant","type":"message"}],"status":"completed",'
             b'"usage":{"input_tokens":30,"output_tokens":3,"total_tokens":33,"input_tokens_details":'
             b'{"cached_tokens":29}}}')
NATIVE = (b'{"index":0,"content":" 1","tokens":[],"id_slot":0,"stop":true,"model":"tiny","tokens_predicted":2,'
          b'"tokens_evaluated":10,"generation_settings":{"seed":4294967295,"n_predict":2},"prompt":"hello there",'
          b'"timings":{"prompt_n":9,"predicted_n":2}}')


def test_each_non_streamed_shape_gives_prompt_and_completion():
    assert read_body(CHAT) == (30, 5)
    assert read_body(MESSAGES) == (30, 3)  # Anthropic's input_tokens leaves out the 29 read from cache
    assert read_body(RESPONSES) == (30, 3)  # the Responses API counts cached input inside input_tokens
    assert read_body(NATIVE) == (10, 2)  # llama-server's /completion and /infill: no usage member
    anthropic_cache_write = b'{"type":"message","usage":{"input_tokens":12,"cache_creation_input_tokens":24,' \
                            b'"cache_read_input_tokens":0,"output_tokens":40}}'
    assert read_body(anthropic_cache_write) == (36, 40)
    embeddings = json.dumps({"object": "list", "data": [{"embedding": [0.25] * 50_000, "index": 0}],
                             "model": "e", "usage": {"prompt_tokens": 4, "total_tokens": 4}}).encode()
    assert read_body(embeddings) == (4, None)
    assert read_body(b"not json") == (None, None)
    assert read_body(b'{"content": "usage", "usage_like": 3}') == (None, None)


def test_verbose_puts_usage_far_from_the_end_and_is_read_all_the_same():
    """llama-server's `"verbose": true` appends `__verbose` after usage: with a long prompt the
    usage sat outside the 4 KiB tail the proxy scanned (issue 34 A.2: 4 requests charged 0)."""
    answer = json.loads(CHAT)
    answer["__verbose"] = {"prompt": "x" * 20_000, "tokens_evaluated": 30, "generation_settings": {}}
    body = json.dumps(answer).encode()
    assert body.index(b'"usage"') < len(body) - 20_000
    assert read_body(body) == (30, 5)


def test_a_usage_member_the_caller_had_echoed_is_not_the_engines():
    """Only the answer's top-level usage counts: a `usage` property in the caller's own JSON schema
    (echoed in __verbose's generation settings, or a Responses answer's tools) after the real one
    must not bill the caller 0."""
    answer = json.loads(CHAT)
    answer["__verbose"] = {"generation_settings": {"json_schema": {"properties": {"usage": {
        "prompt_tokens": 0, "completion_tokens": 0}}}}}
    assert read_body(json.dumps(answer).encode()) == (30, 5)
    answer = json.loads(RESPONSES)
    answer["tools"] = [{"type": "function", "name": "f", "parameters": {"properties": {
        "usage": {"input_tokens": 0, "output_tokens": 0}}}}]
    assert read_body(json.dumps(answer).encode()) == (30, 3)
    native = json.loads(NATIVE)
    native["generation_settings"]["json_schema"] = {"usage": {"prompt_tokens": 0}}
    assert read_body(json.dumps(native).encode()) == (10, 2)


def _events(*payloads: dict | str, event_names: bool = False) -> bytes:
    out = []
    for p in payloads:
        data = p if isinstance(p, str) else json.dumps(p)
        name = f"event: {p['type']}\n" if event_names and isinstance(p, dict) else ""
        out.append(f"{name}data: {data}\n\n")
    return "".join(out).encode()


def _chunk(delta: dict, finish=None) -> dict:
    return {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}], "id": "chatcmpl-pn",
            "model": "tiny", "object": "chat.completion.chunk"}


def test_a_llama_server_chat_stream_with_usage():
    reader = StreamReader(shape_of("/v1/chat/completions"))
    reader.feed(_events(_chunk({"role": "assistant", "content": None}), _chunk({"content": "+"}),
                        _chunk({"content": ""}), _chunk({"content": " H"})))
    assert (reader.prompt, reader.completion, reader.streamed, reader.done) == (None, None, 3, False)
    assert reader.first_id == "chatcmpl-pn"
    reader.feed(_events(_chunk({}, "length"), {"choices": [], "object": "chat.completion.chunk", "usage": {
        "completion_tokens": 3, "prompt_tokens": 30, "total_tokens": 33}, "timings": {"prompt_n": 1}}, "[DONE]"))
    assert (reader.prompt, reader.completion, reader.done) == (30, 3, True)


def test_a_llama_cpp_python_stream_has_no_usage_and_an_event_per_token():
    reader = StreamReader("chat")
    reader.feed(_events(_chunk({"role": "assistant"}), _chunk({"content": "w"}), _chunk({"content": ""}),
                        _chunk({"content": "Z"}), _chunk({}, "length"), "[DONE]"))
    assert (reader.prompt, reader.completion, reader.streamed, reader.done) == (None, None, 3, True)
    completions = StreamReader("completions")
    text = [{"choices": [{"text": t, "index": 0, "finish_reason": None}]} for t in ("\u02d3", "e", "", " had")]
    completions.feed(_events(*text, {"choices": [{"text": "", "index": 0, "finish_reason": "length"}]}, "[DONE]"))
    assert (completions.streamed, completions.done) == (4, True)  # max_tokens 4: the engine's 4


def test_done_is_the_last_event_not_the_word_in_a_text():
    reader = StreamReader("chat")
    reader.feed(_events(_chunk({"content": "data: [DONE]"}), _chunk({"content": 'type":"message_stop"'})))
    assert not reader.done
    data = _events(_chunk({"content": "x"}), "[DONE]")
    assert data[done_at(data):] == b"data: [DONE]\n\n"
    assert done_at(_events(_chunk({"content": "x"}))) == -1


def test_an_anthropic_stream_states_input_at_its_start_and_output_at_its_end():
    reader = StreamReader(shape_of("/v1/messages"))
    start = {"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant",
                                                  "usage": {"cache_read_input_tokens": 29, "input_tokens": 1,
                                                            "output_tokens": 0}}}
    delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "W"}}
    reader.feed(_events(start, {"type": "content_block_start", "index": 0}, delta, delta, event_names=True))
    assert (reader.prompt, reader.completion, reader.streamed, reader.done) == (30, 0, 2, False)  # left here: 30 + 2
    reader.feed(_events(delta, {"type": "content_block_stop", "index": 0}, {
        "type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 3}},
        {"type": "message_stop"}, event_names=True))
    assert (reader.prompt, reader.completion, reader.done) == (30, 3, True)


def test_a_responses_stream_ends_at_response_completed():
    reader = StreamReader(shape_of("/v1/responses"))
    created = {"type": "response.created", "response": {"id": "r", "status": "in_progress", "usage": None}}
    delta = {"type": "response.output_text.delta", "item_id": "m", "delta": "\u00fd B"}
    reader.feed(_events(created, delta, delta, {"type": "response.output_text.done", "text": " 0 B"},
                        event_names=True))
    assert (reader.prompt, reader.streamed, reader.done) == (None, 2, False)
    reader.feed(_events({"type": "response.completed", "response": {
        "id": "r", "status": "completed", "usage": {"input_tokens": 30, "output_tokens": 3, "total_tokens": 33,
                                                    "input_tokens_details": {"cached_tokens": 29}}},
        "timings": {"prompt_n": 1}}, event_names=True))
    assert (reader.prompt, reader.completion, reader.done) == (30, 3, True)


def test_a_native_stream_carries_the_running_figures():
    reader = StreamReader(shape_of("/completion"))
    reader.feed(b'data: {"index":0,"content":"9","tokens":[323],"stop":false,"tokens_predicted":1,'
                b'"tokens_evaluated":10}\n\n')
    assert (reader.prompt, reader.completion, reader.done) == (10, 1, False)
    reader.feed(b'data: {"index":0,"content":"","tokens":[],"stop":true,"tokens_predicted":2,"tokens_evaluated":10,'
                b'"generation_settings":{"json_schema":{"tokens_predicted":0}},"timings":{"predicted_n":2}}\n\n')
    assert (reader.prompt, reader.completion, reader.done) == (10, 2, True)
    assert shape_of("/infill") == "native"


def test_the_engine_is_asked_to_count_a_prompt_by_its_own_route():
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                       "stream_options": {"include_usage": True}, "max_tokens": 40}).encode()
    assert count_request("llama-server", "/v1/chat/completions", chat) == ("/v1/chat/completions/input_tokens", chat)
    assert count_request("llama-server", "/v1/messages", b'{"model":"m"}')[0] == "/v1/messages/count_tokens"
    assert count_request("llama-server", "/v1/responses", b'{"model":"m"}')[0] == "/v1/responses/input_tokens"
    path, body = count_request("llama-server", "/v1/completions", b'{"model":"m","prompt":"hello there"}')
    assert path == "/tokenize" and json.loads(body) == {"content": "hello there", "add_special": True,
                                                        "parse_special": True}
    path, body = count_request("llama-cpp-python", "/v1/completions", b'{"model":"m","prompt":"hello there"}')
    assert path == "/extras/tokenize/count" and json.loads(body) == {"input": "hello there"}
    # llama-cpp-python has no route that applies the chat template: the same request, unstreamed, one token
    path, body = count_request("llama-cpp-python", "/v1/chat/completions", chat)
    assert path == "/v1/chat/completions"
    assert json.loads(body) == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False,
                                "max_tokens": 1}
    path, body = count_request("llama-server", "/infill", b'{"input_prefix":"a","n_predict":50,"stream":true}')
    assert path == "/infill" and json.loads(body) == {"input_prefix": "a", "stream": False, "n_predict": 1}
    assert count_request("llama-server", "/v1/embeddings", b'{"input":"x"}') is None
    assert count_request("llama-server", "/v1/chat/completions", b"[1]") is None
    assert counted(b'{"input_tokens":30,"object":"response.input_tokens"}') == 30
    assert counted(b'{"count":10}') == 10
    assert counted(b'{"tokens":[1,428,273]}') == 3
    assert counted(CHAT) == 30
    assert counted(b"oops") is None


# The end-of-stream patterns as one alternation led by `(?m)^` (before a 100-event chunk took
# 579 us to search): the reader's split form must find exactly what these find.
_OLD_DONE = re.compile(rb'(?m)^data:[ \t]*\[DONE\][ \t]*\r?$|"type"\s*:\s*"(?:message_stop|response\.completed)"')
_OLD_DONE_AT = re.compile(rb"(?m)^data:[ \t]*\[DONE\]")
_PIECES = [b"data:", b"data: ", b"[DONE]", b"\n", b"\r\n", b"\n\n", b" ", b"\t", b"x", b"data: [DONE]",
           b'"type"', b":", b'"message_stop"', b'"response.completed"', b'"type": "message_stop"', b"\r"]


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=12))
def test_the_end_of_a_stream_is_found_where_the_old_pattern_found_it(pieces):
    data = b"".join(pieces)
    reader = StreamReader("chat")
    reader.feed(data)
    assert reader.done == (_OLD_DONE.search(data) is not None), data
    old = _OLD_DONE_AT.search(data)
    assert done_at(data) == (old.start() if old else -1), data


def test_the_end_of_a_long_chunk_is_found():
    chunk = _events(*[_chunk({"content": "tok"})] * 100) + b"data: [DONE]\n\n"
    reader = StreamReader("chat")
    reader.feed(chunk)
    assert reader.done and reader.streamed == 100
    assert chunk[done_at(chunk):] == b"data: [DONE]\n\n"
    reader = StreamReader("chat")
    reader.feed(chunk.replace(b"data: [DONE]", b"data: [DONE] x"))  # not a line of its own
    assert not reader.done


def _old_strip_usage_events(data: bytes) -> bytes:
    """strip_usage_events as it was: a split at every event boundary (a look-behind tried each byte)."""
    kept = []
    for event in re.split(rb"(?<=\n\n)|(?<=\r\n\r\n)", data):
        if b'"usage"' in event and event.lstrip().startswith(b"data:"):
            try:
                payload = json.loads(event.lstrip()[5:])
            except ValueError:
                payload = None
            if isinstance(payload, dict) and payload.get("usage") and not payload.get("choices"):
                continue
        kept.append(event)
    return b"".join(kept)


_USAGE_EVENT = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
_STRIP_PIECES = [_USAGE_EVENT, b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":1}}',
                 b'data: {"usage":null}', b'data: "usage"', b': "usage" comment', b"data: [DONE]",
                 b'data: {"choices":[{"delta":{"content":"usage"}}]}', b"\n\n", b"\r\n\r\n", b"\n", b"\r\n",
                 b" ", b"data:", b'"usage"', b"{", b"}"]


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.sampled_from(_STRIP_PIECES), max_size=12))
def test_usage_only_events_are_stripped_as_before(pieces):
    data = b"".join(pieces)
    assert strip_usage_events(data) == _old_strip_usage_events(data), data


def test_a_long_chunk_loses_only_its_usage_event():
    events = _events(*[_chunk({"content": "tok"})] * 100)
    chunk = events + _USAGE_EVENT + b"\n\ndata: [DONE]\n\n"
    assert strip_usage_events(chunk) == events + b"data: [DONE]\n\n"
    assert strip_usage_events(events) is events  # nothing to strip: the same bytes, not a copy


_HINT_OLD = re.compile(rb'"usage"\s*:\s*\{|"stop"\s*:\s*true')


def _old_usage_figures(data: bytes) -> tuple:
    """What the reader took from a chunk's usage-bearing events before it skipped the events
    ahead of the first `"usage"` / `"stop"`: every payload of the chunk was split out and tried."""
    prompt = completion = None
    stop = started = False
    if (b'"usage"' in data or b'"stop"' in data) and _HINT_OLD.search(data):
        for payload in sse_payloads(data):
            if not _HINT_OLD.search(payload):
                continue
            try:
                event = json.loads(payload)
            except (ValueError, UnicodeDecodeError, RecursionError):
                continue
            p, c = from_object(event)
            prompt = p if p is not None else prompt
            completion = c if c is not None else completion
            if isinstance(event, dict):
                stop = stop or event.get("stop") is True
                started = started or event.get("type") == "message_start"
    return prompt, completion, stop, started


_FEED_PIECES = [_USAGE_EVENT, b'data: {"stop": true, "tokens_evaluated": 4, "tokens_predicted": 2}',
                b'data: {"type": "message_start", "message": {"usage": {"input_tokens": 7}}}',
                b'data: {"usage":\ndata: {"prompt_tokens": 5, "completion_tokens": 1}}', b'data: "stop"',
                b'data: {"choices":[{"delta":{"content":"x"}}]}', b"\n\n", b"\r\n\r\n", b"\n", b"\r\n", b"\r",
                b"data: ", b'"usage"', b'"stop"', b": true", b"{", b"}"]


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.sampled_from(_FEED_PIECES), max_size=12), st.sampled_from(["chat", "native", "messages"]))
def test_usage_is_read_from_a_chunk_as_before(pieces, shape):
    data = b"".join(pieces)
    reader = StreamReader(shape)
    reader.feed(data)
    prompt, completion, stop, started = _old_usage_figures(data)
    if shape != "native":  # native events' running figures are read from every event besides
        assert (reader.prompt, reader.completion) == (prompt, completion), data
    assert reader.started == started, data
    if shape == "native" and stop:
        assert reader.done, data
