"""The request side of the proxy on both llama.cpp engines: request ids of every shape (issue 32
#1), bodies read by the type they came as (issue 34 #3), and a slot freed once its client has
gone even when the client asked for llama-server's resumable streams (issue 34 #8)."""
from __future__ import annotations

import json
import re
import time
import uuid

import httpx
import pytest

from tests.procs import stop_process
from tests.proxy.conftest import AiohttpBackend

ENGINES = ("llama-cpp-python", "llama-server")
NAMES = {"llama-cpp-python": "rs-lcp", "llama-server": "rs-ls"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def engines(proxy_console, backends):
    """uvicorn, the default server (under daphne, Twisted answers a bare 400 itself to a body
    labelled multipart that it cannot parse as one, before the console sees it)."""
    # The slot test's answer must outlast its client by far: llama-server caps a slot at the tiny
    # model's 2,048 tokens (done in about a second here), so it shifts the context and goes on
    # (30,000 tokens took 150 s here, read to the end).
    servers = {engine: backends.start(NAMES[engine], engine=engine, n_ctx=2048,
                                      context_shift=engine == "llama-server") for engine in ENGINES}
    proxy_console.set_instances([{"name": NAMES[e], "port": s.port, "backend": e} for e, s in servers.items()])
    proxy_console.wait_models(set(NAMES.values()))
    yield proxy_console, servers
    for server in servers.values():
        stop_process(server.proc)


def _chat(console, model: str, **kwargs) -> httpx.Response:
    headers = {**console.auth, **kwargs.pop("headers", {})}
    if "content" not in kwargs:
        kwargs["json"] = {"model": model, **CHAT}
    return httpx.post(f"{console.url}/v1/chat/completions", headers=headers, timeout=60, **kwargs)


def _rows(console, request_id: str) -> list[dict]:
    """The request log's rows for `request_id` (written every XGEN_USAGE_FLUSH s): polled for up to 15 s."""
    deadline = time.monotonic() + 15
    while True:
        rows = httpx.get(f"{console.url}/api/requests", headers=console.auth,
                         params={"request_id": request_id}).json()["items"]
        if rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.3)


# ---------------------------------------------------------------- request ids (issue 32 #1)
SHAPES = [str(uuid.uuid4()), uuid.uuid4().hex, "req-42", "bar-req-1796237782", "trace/" + "x:y=z " * 20 + "end"[:2]]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_callers_request_id_of_any_shape_reaches_every_engine(engines, engine):
    """llama-cpp-python answers 400 to an X-Request-ID that is no UUID: the backend gets the
    console's own id; the caller's is echoed and kept in the request log, found by either."""
    console, _ = engines
    long_id = (uuid.uuid4().hex + "-" + "a1." * 40)[:128]  # one of its own for each engine
    for sent in [*SHAPES, long_id]:
        assert len(sent) <= 128
        r = _chat(console, NAMES[engine], headers={"X-Request-ID": sent})
        assert r.status_code == 200, (sent, r.status_code, r.text[:300])
        assert r.json()["choices"] and r.headers["x-request-id"] == sent
    (row,) = _rows(console, long_id)
    assert row["client_request_id"] == long_id and re.fullmatch(r"[0-9a-f]{32}", row["request_id"])
    assert row["model"] == NAMES[engine] and row["status"] == 200
    assert _rows(console, row["request_id"]) == [row]  # the console's own id finds the same row


@pytest.mark.parametrize("sent", ["réq-1".encode(), b"x" * 129, b"two\tparts", b"\xff" * 8])
def test_a_request_id_that_is_not_printable_ascii_is_refused(engines, sent):
    console, _ = engines
    r = _chat(console, NAMES["llama-cpp-python"], headers={"X-Request-ID": sent})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_id", r.text
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])  # answered with the console's id


def test_an_empty_request_id_is_none(engines):
    console, _ = engines
    r = _chat(console, NAMES["llama-cpp-python"], headers={"X-Request-ID": ""})
    assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


# ---------------------------------------------------------------- content types (issue 34 #3)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("content_type", [
    "application/x-www-form-urlencoded",  # what `curl -d` sends with a JSON body
    "Application/JSON; charset=UTF-8",
    "application/json;charset=utf8",  # how some clients spell it
    None,
])
def test_json_bodies_reach_every_engine_as_json(engines, engine, content_type):
    console, _ = engines
    body = json.dumps({"model": NAMES[engine], **CHAT}).encode()
    headers = {"Content-Type": content_type} if content_type else {}
    r = _chat(console, NAMES[engine], content=body, headers=headers)
    assert r.status_code == 200, (content_type, r.status_code, r.text[:300])
    assert r.json()["model"] and r.json()["choices"]


@pytest.mark.parametrize("path,content_type,body,status", [
    # A JSON body labelled a form took the multipart branch: routed to any LLM, stream not seen.
    ("/v1/chat/completions", "Multipart/form-data; boundary=x", b'{"model": "rs-ls", "messages": []}', 415),
    ("/v1/chat/completions", "text/plain", b'{"model": "rs-ls", "messages": []}', 415),
    ("/v1/chat/completions", "application/json; charset=utf-16", b'{"model": "rs-ls", "messages": []}', 415),
    ("/v1/chat/completions", "application/x-www-form-urlencoded", b"model=rs-ls&messages=x", 415),
    ("/v1/chat/completions", "application/json", '{"model": "rs-ls"}'.encode("utf-16"), 400),
    ("/v1/audio/transcriptions", "multipart/form-data", b'{"model": "rs-ls"}', 400),  # no boundary
    ("/v1/audio/transcriptions", "multipart/form-data; boundary=b1", b'{"model": "rs-ls"}', 400),  # not a form
])
def test_a_body_whose_type_and_content_disagree_is_refused(engines, path, content_type, body, status):
    console, _ = engines
    r = httpx.post(f"{console.url}{path}", content=body, timeout=30,
                   headers={**console.auth, "Content-Type": content_type})
    assert r.status_code == status, (content_type, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["code"] == ("unsupported_media_type" if status == 415 else "invalid_request" if
                             path.startswith("/v1/audio") else "invalid_json") and error["message"]


def test_a_form_is_routed_by_its_model_field_as_the_engine_reads_it(engines):
    """llama-server transcribes from a form: the console reads its `model` part the same way."""
    console, _ = engines
    form = (b"--b1\r\nContent-Disposition: form-data; name=\"file\"; filename=\"model\"\r\n"
            b"Content-Type: audio/wav\r\n\r\nRIFF0000WAVE\r\n"
            b"--b1\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nrs-ls\r\n--b1--\r\n")
    r = httpx.post(f"{console.url}/v1/audio/transcriptions", content=form, timeout=30,
                   headers={**console.auth, "Content-Type": "Multipart/Form-Data; boundary=b1"})
    # The tiny model has no audio encoder: llama-server's own refusal, not a console's 4xx about the body.
    assert r.headers.get("x-request-id") and r.json()["error"]["code"] not in (
        "invalid_request", "unsupported_media_type", "model_not_found"), r.text
    # A file named like a parameter is still the file: the model is the form's `model` part.
    tricky = form.replace(b'filename="model"', b'filename="a;name=model"').replace(b"RIFF0000WAVE", b"rs-lcp")
    r = httpx.post(f"{console.url}/v1/audio/transcriptions", content=tricky, timeout=30,
                   headers={**console.auth, "Content-Type": "multipart/form-data; boundary=b1"})
    assert r.json()["error"]["code"] not in ("invalid_request", "model_not_found", "unsupported_by_backend", "not_found"), r.text
    twice = form.replace(b"--b1--", b"--b1\r\nContent-Disposition: form-data; name=model\r\n\r\nrs-lcp\r\n--b1--")
    r = httpx.post(f"{console.url}/v1/audio/transcriptions", content=twice, timeout=30,
                   headers={**console.auth, "Content-Type": "multipart/form-data; boundary=b1"})
    assert r.status_code == 400 and "more than once" in r.json()["error"]["message"]


class FormBackend(AiohttpBackend):
    """Answers POST /v1/audio/transcriptions as an engine would, keeping each body and its Content-Type."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes]] = []
        super().__init__()

    def add_routes(self, app) -> None:
        from aiohttp import web

        async def transcribe(request: web.Request) -> web.Response:
            self.seen.append((request.headers["Content-Type"], await request.read()))
            return web.json_response({"text": "ok"})

        app.router.add_post("/v1/audio/transcriptions", transcribe)


def test_an_alias_in_a_form_reaches_the_engine_as_the_served_name(engines):
    """vLLM checks the model a form names: its `model` part is rewritten to the served name, as a
    JSON body's `model` is (it went as the alias)."""
    console, servers = engines
    engine = FormBackend()
    rows = [{"name": NAMES[e], "port": s.port, "backend": e} for e, s in servers.items()]
    try:
        console.set_instances([*rows, {"name": "whisper", "port": engine.port, "backend": "vllm",
                                       "aliases": ["whisper-alias"]}])
        console.wait_models({*NAMES.values(), "whisper"})
        form = (b"--b1\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-alias\r\n"
                b"--b1\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--b1--\r\n")
        r = httpx.post(f"{console.url}/v1/audio/transcriptions", content=form, timeout=30,
                       headers={**console.auth, "Content-Type": "Multipart/Form-Data; boundary=b1"})
        assert r.status_code == 200 and r.json() == {"text": "ok"}, r.text
        content_type, body = engine.seen[-1]
        assert content_type == "multipart/form-data; boundary=b1"
        assert body == form.replace(b"whisper-alias", b"whisper")
    finally:
        console.set_instances(rows)
        console.wait_models(set(NAMES.values()))
        engine.stop()


ODD_TYPES = ["", "application/json", 'APPLICATION/JSON;charset="utf-8"', "application/json; charset=", ";",
             "multipart/form-data", "multipart/form-data; boundary=", 'multipart/form-data; boundary=""',
             "multipart/form-data; boundary=" + "a" * 71, "multipart/form-data; boundary=b; boundary=c",
             "multipart/form-data; boundary=b", "text/plain", "application/xml", "\xff/\xff",
             "application/x-www-form-urlencoded; charset=utf-8"]
ODD_BODIES = [b"", b"{}", json.dumps({"model": "rs-lcp", **CHAT, "max_tokens": 1}).encode(), b"--b\r\n\r\n",
              b"--b\r\nContent-Disposition: form-data; name=model\r\n\r\nrs-lcp\r\n--b--\r\n", b"\xff\xfe"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/audio/transcriptions"])
def test_odd_content_types_are_answered_in_openai_shape(engines, path):
    """Every media type x body x route: an answer below 500 (the engine's own included), each
    error in the OpenAI shape."""
    console, _ = engines
    seen = set()
    with httpx.Client(base_url=console.url, headers=console.auth, timeout=60) as client:
        for content_type in ODD_TYPES:
            for body in ODD_BODIES:
                r = client.post(path, content=body, headers={"Content-Type": content_type.encode("latin-1")})
                assert r.status_code < 500, (content_type, body[:40], r.status_code, r.text[:300])
                if r.status_code >= 400:
                    assert set(r.json()["error"]) == {"message", "type", "code"}, r.text[:300]
                seen.add(r.status_code)
    assert {400, 415} <= seen


# ---------------------------------------------------------------- slots (issue 34 #8)
def _slot_when(slots_url: str, ready, timeout: float = 10.0) -> dict | None:
    """llama-server's one slot once `ready(slot)` holds, polled for `timeout` s (None: it never did)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slot = httpx.get(slots_url).json()[0]
        if ready(slot):
            return slot
        time.sleep(0.05)
    return None


def test_a_slot_is_free_once_its_client_left_even_with_a_conversation_id(engines):
    """X-Conversation-Id put llama-server in resumable-stream mode: generation went on after the
    client left (slots busy for minutes), and another key with the same id could end the stream.
    The header never reaches the engine now, so leaving frees the slot."""
    console, servers = engines
    slots_url = f"{servers['llama-server'].base_url}/slots"
    body = {"model": "rs-ls", "prompt": "once", "max_tokens": 30000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{console.url}/v1/completions", json=body, timeout=60,
                      headers={**console.auth, "X-Conversation-Id": "conv-shared"}) as r:
        assert r.status_code == 200
        # The iterator is kept: a `for line in r.iter_lines(): break` drops it, and httpcore closes
        # the connection as the generator is finalised (at once, or at the next garbage collection):
        # the client would have left before /slots is read, which the console rightly passes on.
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        slot = httpx.get(slots_url).json()[0]
        assert slot["is_processing"], slot  # generating now
    assert _slot_when(slots_url, lambda slot: not slot["is_processing"]) is not None, \
        "the slot is still busy 10 s after its client left"
    # A slot still generating the 30,000 tokens (about 150 s here) would hold this request past its timeout.
    r = httpx.post(f"{console.url}/v1/completions", json={"model": "rs-ls", "prompt": "a", "max_tokens": 2},
                   headers={**console.auth, "X-Conversation-Id": "conv-shared"}, timeout=20)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
