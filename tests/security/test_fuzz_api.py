"""Fuzzing: schemathesis generates requests for every operation in our own OpenAPI schema and
sends them to a real console process as an admin. No answer may be a 5xx, and every error must
have the OpenAI shape. The example budget is fixed and derandomized, so CI runs are repeatable.

(schemathesis' pytest plugin does not run under pytest 9, so its strategies are driven with
Hypothesis directly: one test per operation.)"""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.conftest import Console, start_console
from tests.procs import stop_process
from xgenconsole.api import api

EXAMPLES_PER_OPERATION = 30
SCHEMA = schemathesis.openapi.from_dict(api.get_openapi_schema())
OPERATIONS = {op.ok().label: op.ok() for op in SCHEMA.get_all_operations()}
CASES_RUN: list[str] = []
UPSTREAM_CODES = {"no_backend", "upstream_unreachable", "upstream_error"}


@pytest.fixture(scope="module")
def admin_key(console) -> str:
    return console.manage("createapikey", "--username", console.admin_user).stdout.strip()


def test_the_served_schema_is_the_one_fuzzed(console, admin_key):
    with httpx.Client(base_url=console.url) as client:
        client.get("/accounts/login/")
        client.post("/accounts/login/", data={"username": console.admin_user, "password": console.admin_password,
                                              "csrfmiddlewaretoken": client.cookies.get("csrftoken")})
        served = client.get("/api/openapi.json")
    assert served.status_code == 200
    assert sorted(served.json()["paths"]) == sorted(api.get_openapi_schema()["paths"])


def test_the_new_inference_operations_are_fuzzed():
    assert {"POST /api/inference/v1/responses", "POST /api/inference/v1/messages",
            "POST /api/inference/v1/messages/count_tokens", "POST /api/inference/{route}",
            "POST /api/inference/v1/rerank", "POST /api/inference/v1/score"} <= set(OPERATIONS)


def test_the_upload_job_operations_are_fuzzed():
    assert {"POST /api/storage/upload", "GET /api/storage/uploads", "GET /api/storage/uploads/{job_id}",
            "POST /api/storage/uploads/{job_id}/cancel"} <= set(OPERATIONS)


def test_the_cache_job_operations_are_fuzzed():
    assert {"POST /api/hardware/nodes/{name}/cache/verify", "GET /api/hardware/nodes/{name}/cache/jobs/{job_id}",
            "POST /api/hardware/nodes/{name}/cache/jobs/{job_id}/cancel"} <= set(OPERATIONS)


def test_the_on_demand_operations_are_fuzzed():
    assert {"POST /api/management/start", "POST /api/management/load"} <= set(OPERATIONS)


def test_the_team_operations_are_fuzzed():
    assert {"GET /api/teams", "POST /api/teams", "GET /api/teams/{team_id}", "PATCH /api/teams/{team_id}",
            "DELETE /api/teams/{team_id}", "POST /api/teams/{team_id}/members",
            "DELETE /api/teams/{team_id}/members/{username}", "GET /api/teams/{team_id}/keys",
            "POST /api/teams/{team_id}/keys", "DELETE /api/teams/{team_id}/keys/{key_id}"} <= set(OPERATIONS)
    assert {"POST /api/teams", "PATCH /api/teams/{team_id}", "POST /api/teams/{team_id}/keys"} <= set(OWN_BODIES)


def test_the_replica_operations_are_fuzzed():
    for label in ("POST /api/management/scale", "POST /api/management/autoscale", "POST /api/management/rollout"):
        assert label in OPERATIONS and label in OWN_BODIES


def test_the_preset_operations_are_fuzzed():
    assert {"GET /api/management/presets", "PUT /api/management/presets",
            "DELETE /api/management/presets"} <= set(OPERATIONS)
    assert "PUT /api/management/presets" in OWN_BODIES
    assert {"POST /api/management/adapters", "DELETE /api/management/adapters"} <= set(OPERATIONS)


# Changing and revoking keys go last (in this order): a case may revoke the key the fuzzer signs with.
LAST = ("PATCH /api/keys", "DELETE /api/keys")


def _order(label: str) -> tuple:
    last = [i for i, prefix in enumerate(LAST) if label.startswith(prefix)]
    return (last[0] if last else -1, label)


@pytest.mark.parametrize("label", sorted(OPERATIONS, key=_order))
def test_operation_never_answers_5xx_or_a_non_openai_error(label, console, admin_key):
    operation = OPERATIONS[label]

    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call(base_url=console.url, headers={"Authorization": f"Bearer {admin_key}"},
                             cookies={}, timeout=30)
        CASES_RUN.append(label)
        assert_answer(label, response.status_code, response.text)

    fuzz()
    assert label in CASES_RUN
    assert "Traceback" not in console.log, console.log[-3000:]


def assert_answer(label: str, status: int, text: str) -> None:
    """No 5xx but the proxy's documented upstream answers, and every error in its API's shape."""
    if "/v1/messages" in label:  # Anthropic's Messages paths answer errors in Anthropic's shape
        if status >= 400:
            body = json.loads(text)
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, text[:300]
            assert body["error"]["message"]
            assert status < 500 or status in (502, 503), text[:300]
        return
    if status >= 500:
        # The proxy's documented answers when no backend can serve (api.md), never a crash.
        assert label.startswith("POST /api/inference"), (label, status, text[:500])
        assert json.loads(text)["error"]["code"] in UPSTREAM_CODES, text[:300]
    if status >= 400:
        body = json.loads(text)
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}, text[:300]
        assert body["error"]["message"]


# Issue 34 #3: media types a client may send with a JSON body (or mislabel it with), each odd in its
# own way: capitals, parameters, a multipart or form label on JSON, several types, none at all.
ODD_CONTENT_TYPES = [
    "Application/JSON", "APPLICATION/JSON; CHARSET=UTF8", "application/json; charset=utf-16",
    "application/json;charset=", "application/json, text/plain", "Multipart/form-data",
    "multipart/form-data; boundary=xgen", "application/x-www-form-urlencoded", "Application/X-WWW-Form-Urlencoded",
    "text/plain", "text/event-stream", "application/octet-stream", "application/vnd.api+json", "*/*", ";", "",
]
BODY_OPERATIONS = sorted(label for label, op in OPERATIONS.items() if op.body)


@pytest.fixture(scope="module")
def uvicorn_console(tmp_path_factory) -> Iterator[Console]:
    """The default server: under daphne, Twisted itself answers a bare 400 (no body) to a body
    labelled multipart that it cannot parse as one, before the console sees it (README, servers)."""
    c = start_console(tmp_path_factory.mktemp("fuzz-uvicorn"), server="uvicorn")
    yield c
    assert stop_process(c.proc, timeout=30) == 0, c.log[-3000:]


@pytest.mark.parametrize("label", BODY_OPERATIONS)
def test_a_body_under_any_content_type_is_answered_in_shape(label, uvicorn_console):
    """Every operation that takes a body, its generated bodies sent as JSON under each odd content
    type (two bodies a type): never a 5xx but the proxy's upstream answers, every error in its
    API's shape."""
    console = uvicorn_console
    fresh_admin_key = console.manage("createapikey", "--username", console.admin_user).stdout.strip()
    operation = OPERATIONS[label]
    seen = set()
    sending = [""]  # the content type of this round

    @given(case=operation.as_strategy())
    @settings(max_examples=2, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = httpx.request(
            case.method, console.url + case.formatted_path, params=case.query, content=json.dumps(case.body).encode(),
            headers={"Authorization": f"Bearer {fresh_admin_key}", "Content-Type": sending[0]}, timeout=30)
        seen.add(sending[0])
        CASES_RUN.append(label)
        assert_answer(label, response.status_code, response.text)

    for content_type in ODD_CONTENT_TYPES:
        sending[0] = content_type
        fuzz()
    assert seen == set(ODD_CONTENT_TYPES)
    assert "Traceback" not in console.log, console.log[-3000:]


# The console's own JSON bodies (not the OpenAI-compatible ones, passed on to the engine as they are).
OWN_BODIES = sorted(label for label, op in OPERATIONS.items()
                    if op.body and not label.split(" ", 1)[1].startswith("/api/inference"))


def test_the_console_s_own_bodies_are_known():
    assert {"POST /api/management/load", "POST /api/keys", "PATCH /api/keys/{key_id}",
            "POST /api/download"} <= set(OWN_BODIES)


@pytest.fixture
def fresh_admin_key(console) -> str:
    """A key of its own for each case: the fuzz run above may have revoked any key by its id."""
    return console.manage("createapikey", "--username", console.admin_user).stdout.strip()


@pytest.mark.parametrize("label", OWN_BODIES)
def test_an_unknown_field_in_any_own_body_is_refused_by_name(label, console, fresh_admin_key):
    """Issue 32 #4: whatever else a generated body holds, a field the route does not know is a 400
    unknown_field naming it (refused before the route runs: nothing is changed or revoked)."""
    operation = OPERATIONS[label]

    @given(case=operation.as_strategy())
    @settings(max_examples=5, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    def fuzz(case):
        if not isinstance(case.body, dict):
            return
        case.body = {**case.body, "xgen_no_such_field": 1}
        response = case.call(base_url=console.url, headers={"Authorization": f"Bearer {fresh_admin_key}"},
                             cookies={}, timeout=30)
        error = json.loads(response.text)["error"]
        assert response.status_code == 400 and error["code"] == "unknown_field", (label, response.text[:300])
        assert "'xgen_no_such_field'" in error["message"], error

    fuzz()


def test_fuzz_summary(capsys):
    """Prints how much was fuzzed, for the closing note."""
    with capsys.disabled():
        print(f"\nfuzz: {len(CASES_RUN)} cases over {len(set(CASES_RUN))} operations")
    assert len(set(CASES_RUN)) == len(OPERATIONS)
