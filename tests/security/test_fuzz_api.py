"""Fuzzing: schemathesis generates requests for every operation in our own OpenAPI schema and
sends them to a real console process as an admin. No answer may be a 5xx, and every error must
have the OpenAI shape. The example budget is fixed and derandomized, so CI runs are repeatable.

(schemathesis' pytest plugin does not run under pytest 9, so its strategies are driven with
Hypothesis directly: one test per operation.)"""
from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

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


def test_the_on_demand_operations_are_fuzzed():
    assert {"POST /api/management/start", "POST /api/management/load"} <= set(OPERATIONS)


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
        if "/v1/messages" in label:  # Anthropic's Messages paths answer errors in Anthropic's shape
            if response.status_code >= 400:
                body = json.loads(response.text)
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, response.text[:300]
                assert body["error"]["message"]
                assert response.status_code < 500 or response.status_code in (502, 503), response.text[:300]
            return
        if response.status_code >= 500:
            # The proxy's documented answers when no backend can serve (api.md), never a crash.
            assert label.startswith("POST /api/inference"), (label, response.status_code, response.text[:500])
            assert json.loads(response.text)["error"]["code"] in UPSTREAM_CODES, response.text[:300]
        if response.status_code >= 400:
            body = json.loads(response.text)
            assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}, response.text[:300]
            assert body["error"]["message"]

    fuzz()
    assert label in CASES_RUN
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
