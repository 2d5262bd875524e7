"""Streams that survive a replica (issue 25 #3), on real engines: one real console (`manage.py
serve`) with two llama-server replicas of a tiny model. A stream's replica is killed with SIGKILL
after 10 chunks: the client's stream goes on from the other replica and reads exactly as an
uninterrupted run at temperature 0 (the same text, one id, one `data: [DONE]`, the usage of the
whole answer), and the request log holds one row that says it resumed. `X-XGEN-Resume: off`
keeps today's ending (an error event, the row of a broken stream).

The model is the tiny one with a vocabulary where generated text reads back as the tokens that
generated it (hub.demo `canonical`), and a grammar keeps it to digits: a text prefill then puts
the engine exactly where it stopped, which llama-server's batch and token-by-token paths compute
alike (checked here by hand on token ids). With the usual tiny model the random weights pick byte
tokens ("<0x37>" for "7") that read back as other tokens, and the continuation differs at once."""
from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.faults.conftest import FaultConsole, backends_console

MODEL = "resumable"
GRAMMAR = "root ::= [0-9]+"
MAX_TOKENS = 1500


@pytest.fixture(scope="module")
def console(tmp_path_factory) -> Iterator[FaultConsole]:
    yield from backends_console(tmp_path_factory.mktemp("resume"))


@pytest.fixture(scope="module")
def replicas(console, tmp_path_factory) -> list[dict]:
    from hub.demo import write_tiny_llama_gguf

    model = write_tiny_llama_gguf(tmp_path_factory.mktemp("canonical") / "canonical.gguf", canonical=True,
                                  n_ctx=8192)
    r = console.post("/api/management/load", {"model_path": str(model), "model_name": MODEL,
                                              "backend": "llama-server", "replicas": 2,
                                              "extra_args": {"--ctx-size": 8192, "--threads": 1}})
    assert r.status_code == 202, r.text
    return _wait_ready(console)


def _wait_ready(c: FaultConsole, timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(f"{c.url}/api/management/instances", headers=c.auth, timeout=10)
        rows = [i for i in r.json() if i["model_name"] == MODEL and i["desired_state"] != "STOPPED"]
        if len(rows) == 2 and all(i["state"] == "READY" for i in rows):
            return rows
        time.sleep(0.2)
    raise AssertionError(f"{MODEL}: never 2 READY")


def _body() -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "grammar": GRAMMAR, "stream": True, "stream_options": {"include_usage": True}}


class Read:
    """One streamed answer as the client read it."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.ids: set[str] = set()
        self.done = 0
        self.comments: list[str] = []
        self.errors: list[dict] = []
        self.usage: dict | None = None

    def line(self, line: str) -> None:
        if line.startswith(":"):
            self.comments.append(line)
        elif line == "data: [DONE]":
            self.done += 1
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            if "error" in event:
                self.errors.append(event)
                return
            self.ids.add(event["id"])
            if event.get("usage"):
                self.usage = event["usage"]
            for choice in event["choices"]:
                if choice["delta"].get("content"):
                    self.text.append(choice["delta"]["content"])


def _stream(c: FaultConsole, request_id: str, *, kill_after: int | None = None,
            headers: dict | None = None) -> tuple[Read, dict | None]:
    """Read a stream to its end; with `kill_after`, SIGKILL the replica answering it after that
    many chunks of text (returned: the instance row it had)."""
    read, killed = Read(), None
    with httpx.stream("POST", f"{c.url}/v1/chat/completions", json=_body(), timeout=120,
                      headers={**c.auth, "X-Request-ID": request_id, **(headers or {})}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            read.line(line)
            if kill_after is not None and killed is None and len(read.text) >= kill_after:
                killed = _serving(c)
                os.kill(killed["pid"], signal.SIGKILL)
    return read, killed


def _serving(c: FaultConsole) -> dict:
    """The replica with a request in flight (the console's count), as its instance row."""
    deadline = time.monotonic() + 10
    while True:
        listed = httpx.get(f"{c.url}/v1/models", headers=c.auth, timeout=10).json()["data"]
        busy = [x["id"] for x in next(m for m in listed if m["id"] == MODEL)["instances"] if x["in_flight"]]
        if len(busy) == 1:
            return c.instance(busy[0])
        assert time.monotonic() < deadline, listed
        time.sleep(0.01)


def _row(c: FaultConsole, request_id: str) -> dict:
    deadline = time.monotonic() + 30
    while True:
        rows = httpx.get(f"{c.url}/api/requests", params={"request_id": request_id}, headers=c.auth,
                         timeout=10).json()["items"]
        if rows or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(1.5)  # a second row would be written by the next flush (XGEN_USAGE_FLUSH 1)
    rows = httpx.get(f"{c.url}/api/requests", params={"request_id": request_id}, headers=c.auth,
                     timeout=10).json()["items"]
    assert len(rows) == 1, rows
    return rows[0]


def _resumes_counted(c: FaultConsole, outcome: str) -> float:
    text = httpx.get(f"{c.url}/metrics", headers=c.auth, timeout=10).text
    for line in text.splitlines():
        if line.startswith(f'xgen_stream_resumes_total{{model="{MODEL}",outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_stream_whose_replica_is_killed_goes_on_from_the_other_as_one_stream(console, replicas):
    c = console
    whole, _ = _stream(c, f"whole-{uuid.uuid4()}")
    assert whole.done == 1 and not whole.errors and len(whole.ids) == 1 and not whole.comments
    assert whole.usage and whole.usage["completion_tokens"] == MAX_TOKENS, whole.usage
    text = "".join(whole.text)
    assert len(text) == MAX_TOKENS and text.isdigit()

    rid = f"resumed-{uuid.uuid4()}"
    cut, killed = _stream(c, rid, kill_after=10)
    assert killed is not None
    got = "".join(cut.text)
    assert not cut.errors, cut.errors
    assert got == text, f"differs at {next(i for i, (a, b) in enumerate(zip(got, text, strict=False)) if a != b)}" \
        if got[:len(text)] != text[:len(got)] else f"{len(got)} characters, not {len(text)}"
    assert cut.done == 1 and len(cut.ids) == 1, (cut.done, cut.ids)
    assert [x for x in cut.comments if "resumed" in x] == [": resumed on another replica after the stream broke"]
    # usage once: the original prompt, every completion token of both parts
    assert cut.usage == {**cut.usage, "prompt_tokens": whole.usage["prompt_tokens"],
                         "completion_tokens": MAX_TOKENS,
                         "total_tokens": whole.usage["prompt_tokens"] + MAX_TOKENS}, (cut.usage, whole.usage)

    row = _row(c, rid)
    other = next(i["id"] for i in replicas if i["id"] != killed["id"])
    assert (row["status"], row["resumes"], row["instance_id"], row["error"]) == (200, 1, other, None), row
    assert (row["prompt_tokens"], row["completion_tokens"]) == (whole.usage["prompt_tokens"], MAX_TOKENS), row
    assert _resumes_counted(c, "resumed") == 1
    print(f"\nkilled instance {killed['id']} after 10 of {MAX_TOKENS} tokens; the stream went on on {other}: "
          f"{len(got)} characters as the uninterrupted run, one [DONE]; row {row}")
    c.wait_instance(killed["id"], lambda b: b["state"] == "READY" and b["pid"] != killed["pid"], timeout=90)


def test_a_request_that_turns_resuming_off_ends_with_the_error_as_before(console, replicas):
    c = console
    _wait_ready(c)
    rid = f"no-resume-{uuid.uuid4()}"
    cut, killed = _stream(c, rid, kill_after=10, headers={"X-XGEN-Resume": "off"})
    assert killed is not None
    assert cut.done == 0 and len(cut.errors) == 1 and cut.errors[0]["error"]["code"] == "upstream_error", cut.errors
    assert not any("resumed" in x for x in cut.comments)
    assert 10 <= len(cut.text) < MAX_TOKENS
    row = _row(c, rid)
    assert (row["instance_id"], row["error"], row["resumes"]) == (killed["id"], "upstream_broken", 0), row
    c.wait_instance(killed["id"], lambda b: b["state"] == "READY" and b["pid"] != killed["pid"], timeout=90)
