"""The rules of a resumed stream (serving.proxy.resume, issue 25 #3): which requests may go on
on another replica, what the broken stream carried, the request sent again, and how the new
stream's events read as the first's. End to end on real llama-server replicas, with a SIGKILL:
tests/faults/test_stream_resume.py."""
from __future__ import annotations

import json

import pytest

from serving.proxy import resume
from serving.proxy.replicas import Backend


def _backend(engine: str = "llama-server", n: int = 1) -> Backend:
    return Backend(instance_id=n, model_name="m", type="llm", backend=engine, node="a",
                   base_url=f"http://127.0.0.1:{9000 + n}", created=0)


TWO = [_backend(n=1), _backend(n=2)]
CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _delta(content=None, *, cid: str = "chatcmpl-1", finish=None, **extra) -> bytes:
    delta = {"content": content, **extra}
    return _event({"id": cid, "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish}]})


@pytest.mark.parametrize(("payload", "path", "headers", "candidates", "ok"), [
    (CHAT, "/v1/chat/completions", [], TWO, True),
    ({"model": "m", "stream": True, "prompt": "Once"}, "/v1/completions", [], TWO, True),
    ({**CHAT, "stream": False}, "/v1/chat/completions", [], TWO, False),  # not a stream
    ({**CHAT, "n": 2}, "/v1/chat/completions", [], TWO, False),  # more than one choice
    (CHAT, "/v1/chat/completions", [], TWO[:1], False),  # no other replica
    (CHAT, "/v1/chat/completions", [(b"x-xgen-resume", b"off")], TWO, False),
    (CHAT, "/v1/chat/completions", [(b"x-xgen-resume", b" OFF ")], TWO, False),
    (CHAT, "/v1/chat/completions", [(b"x-xgen-resume", b"on")], TWO, True),
    (CHAT, "/v1/chat/completions", [], [_backend("llama-cpp-python", 1), _backend("llama-cpp-python", 2)], False),
    (CHAT, "/v1/chat/completions", [], [_backend("vllm", 1), _backend("vllm", 2)], True),
    (CHAT, "/v1/embeddings", [], TWO, False),
    (CHAT, "/v1/messages", [], TWO, False),
    ({"model": "m", "stream": True, "prompt": [1, 2, 3]}, "/v1/completions", [], TWO, False),  # token ids
    ({**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "Sure"}]},  # the client's prefill
     "/v1/chat/completions", [], TWO, False),
])
def test_which_streams_may_go_on_elsewhere(payload, path, headers, candidates, ok, settings):
    settings.STREAM_RESUME_MAX = 1
    assert (resume.plan(payload, path, headers, candidates) is not None) is ok


def test_resuming_off_by_setting(settings):
    settings.STREAM_RESUME_MAX = 0
    assert resume.plan(CHAT, "/v1/chat/completions", [], TWO) is None


def test_the_text_a_broken_stream_carried_and_what_stops_a_resume():
    r = resume.Resume("chat")
    r.keep(_delta(None, role="assistant") + _delta("Hel"))
    r.keep(_delta("lo") + b"data: {\"id\": \"chatcmpl-1\", \"choi")  # a cut event is not read
    assert r.text_so_far() is None  # ...and not being JSON, it stops the resume
    r = resume.Resume("chat")
    r.keep(_delta(None, role="assistant") + _delta("Hel"))
    r.keep(_delta("lo") + _delta(", wo"))
    assert r.text_so_far() == ("Hello, wo", 3)
    assert r.first_id == "chatcmpl-1"
    for stop in (_delta("", finish="stop"), _delta(None, tool_calls=[{"index": 0, "id": "x"}]),
                 _delta(None, reasoning_content="thinking"), b"data: [DONE]\n\n",
                 _event({"error": {"message": "boom"}})):
        other = resume.Resume("chat")
        other.keep(_delta("a") + stop)
        assert other.text_so_far() is None, stop
    done = resume.Resume("completions")
    done.keep(_event({"id": "cmpl-1", "choices": [{"index": 0, "text": "Once", "finish_reason": None}]}))
    assert done.text_so_far() == ("Once", 1)


def test_the_request_sent_again():
    chat = json.dumps({**CHAT, "max_completion_tokens": 50}).encode()
    r = resume.Resume("chat")
    again = json.loads(r.next_body(chat, "llama-server", "Hello", 3))
    assert again["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert again["messages"][:-1] == CHAT["messages"]
    assert (again["max_tokens"], again["max_completion_tokens"]) == (97, 47)
    assert "continue_final_message" not in again  # llama-server continues a final assistant message itself
    vllm = json.loads(r.next_body(chat, "vllm", "Hello", 3))
    assert (vllm["continue_final_message"], vllm["add_generation_prompt"]) == (True, False)
    assert r.next_body(chat, "llama-server", "x" * 50, 50) is None  # max_completion_tokens used up
    nothing = json.loads(r.next_body(chat, "llama-server", "", 0))  # broke before any text: sent again as it was
    assert nothing["messages"] == CHAT["messages"]
    completions = resume.Resume("completions")
    again = json.loads(completions.next_body(json.dumps({"prompt": "Once", "max_tokens": 10}).encode(),
                                             "llama-server", " upon", 1))
    assert (again["prompt"], again["max_tokens"]) == ("Once upon", 9)


def test_the_new_streams_events_read_as_the_first_stream():
    r = resume.Resume("chat")
    r.keep(_delta(None, role="assistant") + _delta("Hel") + _delta("lo"))
    text, tokens = r.text_so_far()
    r.begin_resume(text, tokens, "llama-server")
    assert (r.resumes, r.carried, r.done_text, r.echo) == (1, 2, "Hello", "Hello")
    # llama-server opens with a role-only chunk, then repeats the prefill (here split in two)
    out = r.rewrite(_delta(None, cid="chatcmpl-2", role="assistant") + _delta("Hel", cid="chatcmpl-2"),
                    billed_prompt=9)
    assert out == b""
    out = r.rewrite(_delta("lo, w", cid="chatcmpl-2") + _delta("orld", cid="chatcmpl-2"), billed_prompt=9)
    events = [json.loads(line[6:]) for line in out.decode().split("\n") if line.startswith("data: {")]
    assert [e["choices"][0]["delta"]["content"] for e in events] == [", w", "orld"]
    assert {e["id"] for e in events} == {"chatcmpl-1"}
    usage = _event({"id": "chatcmpl-2", "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2,
                                                                 "total_tokens": 14}})
    out = r.rewrite(_delta("", cid="chatcmpl-2", finish="stop") + usage + b"data: [DONE]\n\n", billed_prompt=9)
    events = [json.loads(line[6:]) for line in out.decode().split("\n") if line.startswith("data: {")]
    assert events[0]["choices"][0]["finish_reason"] == "stop"
    assert events[1]["usage"] == {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
    assert out.endswith(b"data: [DONE]\n\n")


def test_an_engine_that_does_not_repeat_the_prefill_keeps_its_text():
    r = resume.Resume("chat")
    r.keep(_delta("Hello"))
    r.begin_resume(*r.text_so_far(), "vllm")
    assert r.echo == ""
    out = r.rewrite(_delta("", cid="x", role="assistant") + _delta("Hello again", cid="x"), billed_prompt=None)
    assert [json.loads(line[6:])["choices"][0]["delta"]["content"] for line in out.decode().split("\n")
            if line.startswith("data: {")] == ["Hello again"]
