"""Usage: Prometheus metrics at /metrics, the in-process summary, its partial, and the Ninja routes."""
from __future__ import annotations

import json

import httpx
import pytest
from django.template.loader import render_to_string
from django.test import AsyncClient
from prometheus_client.parser import text_string_to_metric_families

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}


def _samples(text: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_count_requests_errors_and_tokens_per_instance(proxy_console, echo_backend):
    echo_id, dropper_id = proxy_console.set_instances([{"name": "echo", "port": echo_backend.port},
                                                       {"name": "dropper", "port": echo_backend.port}])
    proxy_console.wait_models({"echo", "dropper"})
    auth = proxy_console.auth
    for _ in range(3):
        assert httpx.post(f"{proxy_console.url}/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
    with httpx.stream("POST", f"{proxy_console.url}/v1/chat/completions", json={**CHAT, "stream": True},
                      headers=auth) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert list(r.iter_lines())[-2:] == ["data: [DONE]", ""]
    assert httpx.post(f"{proxy_console.url}/v1/completions", json={"model": "dropper", "prompt": "x"},
                      headers=auth).status_code == 502

    metrics = httpx.get(f"{proxy_console.url}/metrics", headers=auth)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    s = _samples(metrics.text)
    echo = (("instance", str(echo_id)), ("model", "echo"))
    assert s[("xgen_inference_requests_total", tuple(sorted(echo + (("status", "200"),))))] == 4
    assert s[("xgen_inference_tokens_total", tuple(sorted(echo + (("kind", "prompt"),))))] == 4 * 7
    assert s[("xgen_inference_tokens_total", tuple(sorted(echo + (("kind", "completion"),))))] == 4 * 3
    assert s[("xgen_inference_duration_seconds_count", echo)] == 4
    dropper = (("instance", str(dropper_id)), ("model", "dropper"))
    # It read the request and closed: counted once, not sent again (issue 23; before, retried: "connect").
    assert s[("xgen_inference_errors_total", tuple(sorted(dropper + (("reason", "upstream"),))))] == 1
    assert s[("xgen_inference_rejected_total", (("code", "upstream_error"),))] >= 1


@pytest.fixture
def echo_instance(transactional_db, echo_backend):
    from django.utils import timezone

    from hardware.models import Node
    from serving.models import ModelInstance
    from serving.proxy.replicas import routing_table

    node = Node.objects.create(name="gpu-local", address="127.0.0.1", last_heartbeat=timezone.now())
    inst = ModelInstance.objects.create(model_name="echo", model_path="/m", backend="echo", node=node,
                                        port=echo_backend.port, state="READY", ready_at=timezone.now())
    routing_table.invalidate()
    return inst


async def test_the_ninja_routes_call_the_same_core_and_feed_the_usage_partial(echo_instance, viewer):
    from serving.proxy.metrics import usage_summary
    from serving.proxy.upstream import shutdown_proxy

    # (this AsyncClient passes auth reliably only as a per-request lower-case header)
    client = AsyncClient()
    auth = {"authorization": f"Bearer {viewer.key}"}
    try:
        listing = await client.get("/api/inference/v1/models", headers=auth)
        assert listing.status_code == 200 and [m["id"] for m in listing.json()["data"]] == ["echo"]
        r = await client.post("/api/inference/v1/chat/completions", data=CHAT, content_type="application/json", headers=auth)
        assert r.status_code == 200
        body = json.loads(b"".join([chunk async for chunk in r.streaming_content]))
        assert body["object"] == "chat.completion" and "authorization" not in body["headers"]
        assert r["x-request-id"] == body["headers"]["x-request-id"]

        r = await client.post("/api/inference/v1/chat/completions", data={**CHAT, "stream": True},
                              content_type="application/json", headers=auth)
        lines = b"".join([chunk async for chunk in r.streaming_content]).decode().split("\n\n")
        assert lines[-2] == "data: [DONE]"

        missing = await client.post("/api/inference/v1/chat/completions", data={**CHAT, "model": "nope"},
                                    content_type="application/json", headers=auth)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        broken = await client.post("/api/inference/v1/chat/completions", data="{nope",
                                   content_type="application/json", headers=auth)
        assert broken.status_code == 400 and set(broken.json()["error"]) == {"message", "type", "code"}
        anonymous = await AsyncClient().get("/api/inference/v1/models")
        assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"
    finally:
        await shutdown_proxy()

    rows = usage_summary(instance_id=echo_instance.pk)
    assert len(rows) == 1
    row = rows[0]
    assert row["model"] == "echo" and row["requests"] == 2 and row["errors"] == 0 and row["in_flight"] == 0
    assert row["prompt_tokens"] == 14 and row["completion_tokens"] == 6 and row["p50_ms"] > 0
    html = render_to_string("serving/partials/_usage.html", {"usage": rows, "inst": echo_instance})
    assert 'id="usage"' in html and "<td>echo</td>" in html and f"#{echo_instance.pk}" in html
    assert '"model": "echo"' in html.replace("&quot;", '"')
    empty = render_to_string("serving/partials/_usage.html", {"usage": usage_summary(instance_id=-1)})
    assert "No requests through the proxy yet" in empty


def test_the_inference_operations_are_in_the_openapi_docs():
    from xgenconsole.api import api

    paths = api.get_openapi_schema()["paths"]
    for path, method in [("/api/inference/v1/models", "get"), ("/api/inference/v1/models/{model}", "get"),
                         ("/api/inference/v1/chat/completions", "post"), ("/api/inference/v1/completions", "post"),
                         ("/api/inference/v1/embeddings", "post"), ("/api/inference/embedding/v1/models", "get"),
                         ("/api/inference/embedding/v1/embeddings", "post")]:
        assert method in paths[path], path
    chat = paths["/api/inference/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert chat["schema"]
