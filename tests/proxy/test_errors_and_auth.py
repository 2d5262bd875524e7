"""Auth (bearer key, session + CSRF), every error the proxy gives itself, and what reaches a backend."""

from __future__ import annotations

import json
import re
from contextlib import closing

import httpx
import pytest

from tests.proxy.conftest import PROXY_MAX_BODY

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}


def _error(status: int, type_: str, code: str, message: str | None = None):
    def check(response: httpx.Response) -> None:
        assert response.status_code == status, (response.status_code, response.text)
        assert response.headers["content-type"] == "application/json"
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}
        assert body["error"]["type"] == type_ and body["error"]["code"] == code
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        if message is not None:
            assert body["error"]["message"] == message

    return check


@pytest.fixture(scope="module")
def served(proxy_console, echo_backend):
    proxy_console.rows = [
        {"name": "echo", "port": echo_backend.port},
        {"name": "dropper", "port": echo_backend.port},
        {"name": "loading", "port": echo_backend.port, "state": "LOADING"},
    ]
    proxy_console.ids = proxy_console.set_instances(proxy_console.rows)
    proxy_console.wait_models({"echo", "dropper"})
    return proxy_console


def _post(console, path: str, *, headers: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(
        f"{console.url}{path}", headers={**console.auth, **(headers or {})}, timeout=30, **kwargs
    )


@pytest.mark.parametrize("path", ["/v1/models", "/api/inference/v1/models", "/metrics"])
def test_no_credentials_is_401(served, path):
    r = httpx.get(f"{served.url}{path}")
    _error(401, "authentication_error", "unauthorized")(r)
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("auth", ["Bearer xgen_nope", "Basic dmVyYTp4", "Bearer", "Bearer " + "x" * 300])
def test_a_bad_key_is_401(served, auth):
    r = httpx.post(f"{served.url}/v1/chat/completions", json=CHAT, headers={"Authorization": auth})
    _error(401, "authentication_error", "invalid_api_key", "Invalid API key.")(r)


def test_a_revoked_key_stops_working_at_once(served):
    key = served.console.manage("createapikey", "--username", "vera", "--name", "revoke-me").stdout.split()[
        -1
    ]
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.get(f"{served.url}/v1/models", headers=headers).status_code == 200  # now cached
    with closing(_login(served, "admin", "admin-pass-123")) as session:
        r = session.post(
            f"/keys/{_key_id(served, 'revoke-me')}/revoke/",
            headers={"X-CSRFToken": session.cookies["csrftoken"]},
        )
    assert r.status_code in (200, 302), r.text
    _error(401, "authentication_error", "invalid_api_key")(
        httpx.get(f"{served.url}/v1/models", headers=headers)
    )


def _key_id(served, name: str) -> str:
    code = f"from accounts.models import ApiKey; print(ApiKey.objects.get(name={name!r}).pk)"
    return served.console.manage("shell", "-c", code).stdout.split()[-1]


def _login(console, username: str, password: str) -> httpx.Client:
    session = httpx.Client(base_url=console.url, timeout=30)
    session.get("/accounts/login/")
    r = session.post(
        "/accounts/login/",
        data={
            "username": username,
            "password": password,
            "csrfmiddlewaretoken": session.cookies["csrftoken"],
        },
    )
    assert r.status_code == 302, r.text
    return session


def test_a_console_session_may_call_inference_with_the_csrf_header(served):
    with closing(_login(served, "vera", "vera-pass-123")) as session:  # a viewer
        token = session.cookies["csrftoken"]
        listing = session.get("/v1/models")
        assert listing.status_code == 200 and {m["id"] for m in listing.json()["data"]} == {"echo", "dropper"}
        _error(403, "permission_error", "csrf_failed")(session.post("/v1/chat/completions", json=CHAT))
        _error(403, "permission_error", "csrf_failed")(
            session.post("/v1/chat/completions", json=CHAT, headers={"X-CSRFToken": "a" * 32})
        )
        _error(403, "permission_error", "csrf_failed")(
            session.post(
                "/v1/chat/completions",
                json=CHAT,
                headers={"X-CSRFToken": token, "Origin": "http://evil.example"},
            )
        )
        ok = session.post("/v1/chat/completions", json=CHAT, headers={"X-CSRFToken": token})
        assert ok.status_code == 200 and ok.json()["object"] == "chat.completion"
        seen = ok.json()["headers"]
        assert "cookie" not in seen and "x-csrftoken" not in seen  # the session never reaches a backend
        old_session = session.cookies["sessionid"]
        session.post("/accounts/logout/", headers={"X-CSRFToken": token})
    gone = httpx.get(f"{served.url}/v1/models", cookies={"sessionid": old_session})
    _error(401, "authentication_error", "unauthorized")(gone)  # logged out: refused at once
    stale = httpx.get(f"{served.url}/v1/models", cookies={"sessionid": "not-a-session"})
    _error(401, "authentication_error", "unauthorized")(stale)


def test_unknown_model_is_404_and_a_loading_one_503(served):
    _error(404, "not_found_error", "model_not_found", "The model 'nope' does not exist or is not loaded.")(
        _post(served, "/v1/chat/completions", json={**CHAT, "model": "nope"})
    )
    _error(503, "service_unavailable", "no_backend", "No backend for 'loading' is ready yet.")(
        _post(served, "/v1/chat/completions", json={**CHAT, "model": "loading"})
    )
    _error(404, "not_found_error", "model_not_found")(
        httpx.get(f"{served.url}/v1/models/nope", headers=served.auth)
    )
    assert httpx.get(f"{served.url}/v1/models/echo", headers=served.auth).json()["id"] == "echo"
    _error(503, "service_unavailable", "no_backend", "No embedding model is ready.")(
        _post(served, "/v1/embeddings", json={"input": "x"})
    )


@pytest.mark.parametrize(
    "path",
    ["/v1/nope", "/api/inference/v2/models", "/api/inference/embedding/v1/chat/completions", "/metrics/x"],
)
def test_unknown_paths_are_404(served, path):
    _error(404, "not_found_error", "not_found")(_post(served, path, json=CHAT))


@pytest.mark.parametrize(
    "body", [b"not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe", b'{"model": 5}', b'{"model": ""}']
)
def test_a_body_that_is_not_a_json_object_is_400(served, body):
    r = _post(served, "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    _error(400, "invalid_request_error", r.json()["error"]["code"])(r)
    assert r.json()["error"]["code"] in ("invalid_json", "invalid_request")


def test_a_body_past_the_limit_is_413(served):
    big = b'{"model": "echo", "pad": "' + b"x" * PROXY_MAX_BODY + b'"}'
    _error(413, "invalid_request_error", "request_too_large")(
        _post(served, "/v1/chat/completions", content=big)
    )

    def chunked():  # no Content-Length: counted while reading
        yield big[:1000]
        yield big[1000:]

    _error(413, "invalid_request_error", "request_too_large")(
        _post(served, "/v1/chat/completions", content=chunked())
    )
    fits = b'{"model": "echo", "pad": "' + b"x" * (PROXY_MAX_BODY - 100) + b'"}'
    assert _post(served, "/v1/chat/completions", content=fits).status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/embeddings", "POST"),
        ("POST", "/v1/models", "GET"),
        ("DELETE", "/api/inference/v1/completions", "POST"),
        ("POST", "/metrics", "GET"),
    ],
)
def test_a_wrong_method_is_405(served, method, path, allow):
    r = httpx.request(method, f"{served.url}{path}", headers=served.auth)
    _error(405, "invalid_request_error", "method_not_allowed")(r)
    assert r.headers["allow"] == allow


def test_an_upstream_that_fails_before_answering_is_502(served, backends):
    # The backend read the request, then closed: it may have run it, so it is not sent again
    # (issue 23; before, it was retried and answered upstream_unreachable).
    r = _post(served, "/v1/completions", json={"model": "dropper", "prompt": "x"})
    _error(502, "upstream_error", "upstream_error")(r)
    assert "not sent again" in r.json()["error"]["message"]


def test_what_reaches_the_backend_and_what_comes_back(served, echo_backend):
    """Request headers by allowlist (issue 34 #8): the trace context, Accept and the API version
    headers go on; the caller's credentials, hop-by-hop headers, X-Conversation-Id, Accept-Encoding
    and anything custom do not. The backend gets the console's own id, the caller its own back."""
    r = _post(
        served,
        "/v1/chat/completions",
        json=CHAT,
        headers={
            "X-Request-ID": "req-123.abc",
            "Connection": "keep-alive, x-private, openai-beta",
            "Proxy-Authorization": "secret",
            "TE": "trailers",
            "Cookie": "sessionid=abc",
            "X-Custom": "not for the backend",
            "Keep-Alive": "timeout=5",
            "X-Private": "listed in Connection: hop-by-hop",
            "OpenAI-Beta": "listed in Connection too",
            "X-Conversation-Id": "conv-1",
            "Accept-Encoding": "gzip",
            "Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "Tracestate": "congo=t61rcWkgMzE",
            "Anthropic-Version": "2023-06-01",
            "Accept": "application/json",
        },
    )
    assert r.status_code == 200
    seen = r.json()["headers"]
    assert seen["host"] == f"127.0.0.1:{echo_backend.port}"
    for hidden in ("authorization", "cookie", "proxy-authorization", "te", "keep-alive", "x-private", "x-custom",
                   "openai-beta", "x-conversation-id", "x-api-key"):
        assert hidden not in seen, hidden
    assert seen.get("accept-encoding", "identity") == "identity"  # aiohttp's own default, never the caller's gzip
    assert seen.get("connection", "keep-alive") == "keep-alive"  # the client's own, not the caller's
    assert seen["traceparent"] == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert seen["tracestate"] == "congo=t61rcWkgMzE" and seen["anthropic-version"] == "2023-06-01"
    assert seen["accept"] == "application/json" and seen["content-type"] == "application/json"
    assert re.fullmatch(r"[0-9a-f]{32}", seen["x-request-id"])  # the console's UUIDv7, not the caller's
    assert r.headers["x-request-id"] == "req-123.abc"
    # Response headers by allowlist too: the backend's own cookie, server and custom headers stay.
    assert "set-cookie" not in r.headers and "x-backend" not in r.headers
    assert "aiohttp" not in r.headers.get("server", "").lower()
    assert r.json()["body"] == CHAT

    plain = _post(served, "/v1/chat/completions", json=CHAT)
    new_id = plain.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", new_id) and plain.json()["headers"]["x-request-id"] == new_id
    assert re.fullmatch(r"[0-9a-f]{32}", _post(served, "/v1/nope").headers["x-request-id"])
    odd = _post(served, "/v1/chat/completions", json=CHAT, headers={"X-Request-ID": "bad id\twith a tab"})
    _error(400, "invalid_request_error", "invalid_request_id")(odd)


def test_a_json_answer_cut_by_the_backend_reaches_the_client_as_cut(served):
    import json

    # Embeddings go to embedding models only: the echo backend serves one for this test.
    port = served.rows[0]["port"]
    served.set_instances([*served.rows, {"name": "echo-embed", "port": port, "type": "embedding"}])
    served.wait_models({"echo", "dropper", "echo-embed"})
    try:
        r = _post(served, "/v1/embeddings", json={"model": "echo-embed", "input": "x"})  # ends, never hangs
        assert r.status_code == 200 and r.content.startswith(b'{"object": "list"')
        with pytest.raises(json.JSONDecodeError):  # cut where the backend died, not made to look whole
            json.loads(r.content)
    finally:
        served.ids = served.set_instances(served.rows)
        served.wait_models({"echo", "dropper"})
    assert httpx.get(f"{served.url}/v1/models", headers=served.auth).status_code == 200


def test_new_request_ids_are_uuid7_and_ordered_by_time():
    import time
    import uuid

    from serving.proxy.bodies import new_request_id

    first = [new_request_id() for _ in range(5000)]
    time.sleep(0.003)
    later = new_request_id()
    assert len(set(first)) == len(first)
    for value in (*first[:50], later):
        parsed = uuid.UUID(hex=value)
        assert re.fullmatch(r"[0-9a-f]{32}", value) and parsed.version == 7 and parsed.variant == uuid.RFC_4122
        assert abs(int(value[:12], 16) - time.time() * 1000) < 60_000  # its first 48 bits: now, in ms
    assert all(later > v for v in first)  # a later millisecond sorts after every earlier id
    assert sorted(first, key=lambda v: v[:12]) == first  # the time prefix never goes back


@pytest.mark.parametrize("body, kept", [
    # A plain JSON object: the member goes in before its closing brace, every other byte as sent.
    (b'{ "model": "m", "stream": true, "messages": [{"role": "user", "content": "\\u00e9 caf\\u00e9"}] }\n', True),
    (b'{"stream":true,"model":"m"}', True),
    # Not plainly a UTF-8 object: re-serialised, still with usage asked for.
    ('{"stream": true, "model": "m"}'.encode("utf-16"), False),
    (b'\xef\xbb\xbf{"stream": true, "model": "m"}', False),
])
async def test_stream_usage_is_asked_for_without_rewriting_the_body(body, kept):
    from serving.proxy.admission import admit_request
    from serving.proxy.bodies import parse_body
    from serving.proxy.usage import RequestContext

    ctx = RequestContext(request_id="r")
    out = await admit_request(ctx, parse_body(body), body, operation="chat")
    assert ctx.drop_usage_chunk
    assert json.loads(out)["stream_options"] == {"include_usage": True}
    assert json.loads(out)["model"] == "m"
    if kept:
        end = body.rstrip().rindex(b"}")
        assert out == body[:end] + b',"stream_options":{"include_usage":true}' + body[end:]


async def test_stream_options_the_client_sent_are_kept_beside_include_usage():
    from serving.proxy.admission import admit_request
    from serving.proxy.usage import RequestContext

    ctx = RequestContext(request_id="r")
    payload = {"model": "m", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    out = await admit_request(ctx, dict(payload), json.dumps(payload).encode(), operation="chat")
    assert json.loads(out)["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    nulled = b'{"model": "m", "stream": true, "stream_options": null}'
    out = await admit_request(RequestContext(request_id="r"), json.loads(nulled), nulled, operation="chat")
    assert json.loads(out, object_pairs_hook=lambda pairs: [k for k, _ in pairs]).count("stream_options") == 1
    assert json.loads(out)["stream_options"] == {"include_usage": True}
    plain = json.dumps({"model": "m", "stream": True, "stream_options": {"include_usage": True}}).encode()
    ctx = RequestContext(request_id="r")
    assert await admit_request(ctx, json.loads(plain), plain, operation="chat") is plain
    assert not ctx.drop_usage_chunk
