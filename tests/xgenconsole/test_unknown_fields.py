"""Unknown fields in the console's own JSON bodies are refused (issue 32 #4): 400 `unknown_field`
naming each one, on every body of the management, store, download, cache and keys APIs; the
OpenAI-compatible routes pass bodies on as they are (the engine reads what it knows)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import bearer

pytestmark = pytest.mark.django_db

# (method, path, a body the route takes, the unknown fields added to it)
BODIES = [
    ("post", "/api/management/load", {"model_path": "/nowhere.gguf"}, ["max_concurency"]),
    ("post", "/api/management/load", {"model_path": "/nowhere.gguf"}, ["replica_count", "gpu"]),  # replicas: issue 30
    ("post", "/api/management/scale", {"model_name": "x", "replicas": 2}, ["force"]),
    ("post", "/api/management/autoscale", {"model_name": "x", "max_replicas": 2, "target_in_flight": 1},
     ["target"]),
    ("post", "/api/management/rollout", {"model_name": "x"}, ["args"]),
    ("post", "/api/management/unload", {"id": 1}, ["force"]),
    ("post", "/api/management/restart", {"id": 1}, ["hard"]),
    ("post", "/api/management/start", {"id": 1}, ["now"]),
    ("post", "/api/keys", {"name": "k", "username": "admin-user"}, ["rate_limit"]),
    ("patch", "/api/keys/1", {"rpm": 5}, ["rmp"]),
    ("post", "/api/storage/upload", {"local_path": "/x", "format": "gguf", "name": "x"}, ["overwrite"]),
    ("post", "/api/download", {"repo_id": "a/b", "format": "gguf"}, ["branch"]),
    ("post", "/api/hardware/nodes/n1/cache/evict", {"prefix": "gguf/x"}, ["all"]),
    ("post", "/api/hardware/nodes/n1/cache/verify", {"prefix": "gguf/x"}, ["deep"]),
]


def _send(client, method: str, path: str, key: str, body: dict):
    return getattr(client, method)(path, data=json.dumps(body), content_type="application/json", **bearer(key))


@pytest.mark.parametrize(("method", "path", "body", "unknown"), BODIES, ids=[f"{m} {p} {u}" for m, p, _, u in BODIES])
def test_an_unknown_field_is_refused_by_name(client, admin, method, path, body, unknown):
    r = _send(client, method, path, admin.key, {**body, **{name: 1 for name in unknown}})
    assert r.status_code == 400, r.content
    error = r.json()["error"]
    assert error["code"] == "unknown_field" and error["type"] == "invalid_request_error", error
    for name in unknown:
        assert repr(name) in error["message"], error
    assert "model_path" not in error["message"] and "name'" not in error["message"]  # known fields are not named


def test_the_same_bodies_without_the_unknown_field_are_not_refused_for_it(client, admin):
    for method, path, body, _ in BODIES:
        r = _send(client, method, path, admin.key, body)
        error = r.json().get("error")  # a job's answer has "error": null
        assert not isinstance(error, dict) or error.get("code") != "unknown_field", (path, r.content)


def test_an_unknown_field_nested_in_a_known_one_is_not_refused_where_the_body_allows_any(client, admin):
    # extra_args is a free map (each backend's allowlist judges its keys): not an unknown field.
    r = _send(client, "post", "/api/management/load", admin.key,
              {"model_path": "/nowhere.gguf", "extra_args": {"--no-such-flag": 1}})
    assert r.json()["error"]["code"] != "unknown_field", r.content


@pytest.mark.parametrize("path", ["/api/inference/v1/chat/completions", "/api/inference/tokenize"])
def test_openai_compatible_bodies_keep_their_extra_fields(client, admin, path):
    body = {"model": "absent", "messages": [{"role": "user", "content": "hi"}], "content": "hi",
            "mirostat_tau": 5.0, "cache_prompt": True}
    r = _send(client, "post", path, admin.key, body)
    answer = json.loads(b"".join(r.streaming_content) if r.streaming else r.content)
    assert answer["error"]["code"] in ("model_not_found", "no_backend"), answer  # routed on, not refused
