"""The Load dialog, the instances list, one instance's page, its log and the websocket feeds."""
from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from tests.serving.conftest import LLAMA_CPP_PYTHON, NODE


def logged_in(account) -> Client:
    c = Client()
    c.force_login(account.user)
    return c


@pytest.mark.django_db
def test_load_dialog_and_its_verdict(node, operator, viewer, tiny_gguf):
    c = logged_in(operator)
    page = c.get(f"/instances/new/?model_path={tiny_gguf}")
    assert page.status_code == 200 and str(tiny_gguf) in page.content.decode()
    v = c.get("/instances/new/verdict", {"model_path": str(tiny_gguf), "server_type": "embedding",
                                         "extra_args": "--n_ctx 512\nverbose=false"}).content.decode()
    assert "llama-cpp-python" in v and "GGUF on CPU-only" in v and "runs on the CPU of node-t" in v
    assert "--embedding true" in v and "--n_ctx 512" in v and "--model_alias tiny-llama" in v
    bad = c.get("/instances/new/verdict", {"model_path": str(tiny_gguf), "extra_args": "--rm -rf"}).content.decode()
    assert "does not accept --rm" in bad
    assert logged_in(viewer).get("/instances/new/").status_code == 403
    assert logged_in(viewer).post("/instances/new/", {"model_path": str(tiny_gguf)}).status_code == 403


@pytest.mark.django_db
def test_an_on_demand_load_from_the_dialog_is_listed_idle_with_its_policy_and_a_start_button(node, operator,
                                                                                              tiny_gguf):
    c = logged_in(operator)
    page = c.get("/instances/new/").content.decode()
    for field in ('name="policy"', 'name="idle_ttl_s"', 'name="pinned"', 'name="max_concurrency"'):
        assert field in page
    r = c.post("/instances/new/", {"model_path": str(tiny_gguf), "model_name": "tiny-od", "server_type": "llm",
                                   "backend": "auto", "node": NODE, "policy": "on_demand", "idle_ttl_s": "420",
                                   "pinned": "on", "max_concurrency": "2"})
    from serving.models import ModelInstance

    inst = ModelInstance.objects.get()
    assert r.status_code == 302, r.content[:500]
    assert (inst.state, inst.policy, inst.idle_ttl_s, inst.pinned, inst.max_concurrency) == (
        "IDLE", "on_demand", 420, True, 2)
    listing = c.get("/instances/").content.decode()
    assert f'id="inst-policy-{inst.pk}"' in listing and "on demand · pinned" in listing
    assert "idle: the next request starts it" in listing and "max 2 at once" in listing
    assert f'id="inst-start-{inst.pk}"' in listing
    detail = c.get(f"/instances/{inst.pk}/").content.decode()
    assert "idle TTL 420 s" in detail and ">Start</button>" in detail
    # Start asks for a cold start: desired RUNNING, PENDING, like a request would.
    r = c.post(f"/instances/{inst.pk}/restart", HTTP_HX_REQUEST="true")
    inst.refresh_from_db()
    assert r.status_code == 200 and (inst.state, inst.desired_state) == ("PENDING", "RUNNING")


@pytest.mark.django_db
def test_load_form_shows_errors_and_creates_on_success(node, operator, tiny_gguf):
    c = logged_in(operator)
    r = c.post("/instances/new/", {"model_path": str(tiny_gguf), "server_type": "llm", "backend": "auto",
                                   "node": NODE, "extra_args": "--model /etc/passwd"})
    assert r.status_code == 400 and "does not accept --model" in r.content.decode()
    r = c.post("/instances/new/", {"model_path": "/etc/../etc/passwd", "server_type": "llm", "backend": "auto"})
    assert r.status_code == 400 and "contains &#x27;..&#x27;" in r.content.decode()
    from serving.models import ModelInstance

    assert ModelInstance.objects.count() == 0
    r = c.post("/instances/new/", {"model_path": str(tiny_gguf), "model_name": "tiny-page", "server_type": "llm",
                                   "backend": "auto", "node": NODE, "tensor_parallel_size": "1"})
    inst = ModelInstance.objects.get()
    assert r.status_code == 302 and r["Location"] == f"/instances/{inst.pk}/"
    detail = c.get(r["Location"]).content.decode()
    assert "tiny-page" in detail and "PENDING" in detail and 'id="unload-btn"' in detail
    assert "load requested" in detail  # the timeline


@pytest.mark.django_db
def test_viewer_sees_no_actions_and_the_server_refuses_them(node, operator, viewer, tiny_gguf):
    from serving.control.services import request_load

    inst = request_load(model_path=str(tiny_gguf), model_name="t")
    v = logged_in(viewer)
    assert 'id="unload-btn"' not in v.get(f"/instances/{inst.pk}/").content.decode()
    listing = v.get("/instances/").content.decode()
    assert ".operator-only { display: none; }" in listing and "0 ready of 1 active" in listing
    assert v.post(f"/instances/{inst.pk}/unload").status_code == 403
    r = logged_in(operator).post(f"/instances/{inst.pk}/unload", HTTP_HX_REQUEST="true")
    assert r.status_code == 200 and "Unload of t requested" in r.content.decode()
    inst.refresh_from_db()
    assert inst.desired_state == "STOPPED"


@pytest.mark.django_db
def test_log_download_keeps_the_previous_run(node, viewer, tiny_gguf, serving_settings):
    from serving.control.services import request_load
    from serving.node.logs import current_log, previous_log

    inst = request_load(model_path=str(tiny_gguf), model_name="t")
    c = logged_in(viewer)
    assert c.get(f"/instances/{inst.pk}/log").status_code == 404
    current_log(inst.pk).parent.mkdir(parents=True)
    current_log(inst.pk).write_text("line one\nUvicorn running on http://127.0.0.1\n")
    previous_log(inst.pk).write_text("the crashed run\n")
    r = c.get(f"/instances/{inst.pk}/log")
    assert r.status_code == 200 and b"".join(r.streaming_content).startswith(b"line one")
    assert "attachment" in r["Content-Disposition"]
    assert b"crashed run" in b"".join(c.get(f"/instances/{inst.pk}/log?run=previous").streaming_content)
    assert c.get(f"/instances/{inst.pk}/log?run=../../etc").status_code == 404
    page = c.get(f"/instances/{inst.pk}/").content.decode()
    assert '<span class="line">Uvicorn running on http://127.0.0.1</span>' in page and "Previous run" in page


@pytest.mark.django_db
def test_playground_refuses_when_not_ready(node, viewer, tiny_gguf):
    from serving.control.services import request_load

    inst = request_load(model_path=str(tiny_gguf), model_name="t")
    r = logged_in(viewer).post(f"/instances/{inst.pk}/playground", {"prompt": "hi"})
    assert r.status_code == 200 and "t is PENDING, not READY" in r.content.decode()


@pytest.mark.django_db(transaction=True)
async def test_websockets_carry_state_rows_and_log_lines(node, viewer, tiny_gguf):
    from serving.control import events
    from serving.control.services import request_load
    from serving.web.consumers import InstanceConsumer, InstancesConsumer

    inst = await sync_to_async(request_load)(model_path=str(tiny_gguf), model_name="ws")
    listing = WebsocketCommunicator(InstancesConsumer.as_asgi(), "/ws/instances/")
    listing.scope["user"] = viewer.user
    one = WebsocketCommunicator(InstanceConsumer.as_asgi(), f"/ws/instances/{inst.pk}/")
    one.scope["user"] = viewer.user
    one.scope["url_route"] = {"kwargs": {"pk": inst.pk}}
    assert (await listing.connect())[0] and (await one.connect())[0]
    await sync_to_async(inst.mark_caching)(40.0)
    row = await listing.receive_from(timeout=3)
    assert row.startswith('<div id="instances-card"') and 'hx-swap-oob="true"' in row
    assert f'id="inst-row-{inst.pk}"' in row and "CACHING 40%" in row and "1 active" in row
    state = await one.receive_from(timeout=3)
    assert f'id="inst-state-{inst.pk}"' in state and "copying from the store: 40%" in state
    await events.log_lines(inst.pk, ["<b>not html</b>", "second"])
    await sync_to_async(lambda: inst.mark_loading(pid=4242, pgid=4242, port=18123, gpus=[], message="starting"))()
    got = ""
    while 'id="timeline"' not in got or "second" not in got:
        got += await one.receive_from(timeout=3)
    assert "&lt;b&gt;not html&lt;/b&gt;" in got and "beforeend:#log" in got
    await listing.disconnect()
    await one.disconnect()


@pytest.mark.django_db
def test_verdict_on_a_gpu_node_lists_gpus_and_keeps_the_choice(node, operator, tiny_gguf):
    from hardware.models import GpuDevice

    node.backends = [{"name": "llama-server", "available": True, "version": "b6500", "flavour": "cuda",
                      "path": "/opt/llama-server", "reason": ""}]
    node.save()
    for i, used in ((0, 1000), (1, 20000)):
        GpuDevice.objects.create(node=node, index=i, vendor="NVIDIA", type="NVIDIA", name="L4",
                                 memory_total_mib=24000, memory_used_mib=used)
    v = logged_in(operator).get("/instances/new/verdict", {"model_path": str(tiny_gguf), "node": NODE, "gpus": "1"})
    html = v.content.decode()
    assert "fits on GPU 1 of node-t: needs ~0.5 GiB of 3.9 GiB free" in html
    assert "GPU 0 · L4 · 22.5 of 23.4 GiB free" in html
    assert 'value="1" checked' in html and 'value="0" checked' not in html
    assert "/opt/llama-server -m" in html and "-ngl 999" in html
    too_big = logged_in(operator).get("/instances/new/verdict", {"model_path": str(tiny_gguf), "node": NODE,
                                                                 "extra_args": "--ctx-size 99999999"})
    assert "needs ~" in too_big.content.decode() and "largest free is" in too_big.content.decode()


@pytest.mark.django_db
def test_instance_page_shows_proxy_usage(node, viewer, operator, tiny_gguf, monkeypatch):
    from serving.control.services import request_load
    from serving.proxy import metrics

    monkeypatch.setattr(metrics, "_usage", {})  # usage is per process; ids repeat across test databases

    inst = request_load(model_path=str(tiny_gguf), model_name="usage-demo", user=operator.user)
    page = logged_in(viewer).get(f"/instances/{inst.pk}/").content.decode()
    assert 'id="usage"' in page and "No requests through the proxy yet" in page
    metrics.record(model="usage-demo", instance_id=inst.pk, status=200, duration_s=0.05, first_byte_s=0.01,
                   prompt_tokens=11, completion_tokens=7)
    page = logged_in(viewer).get(f"/instances/{inst.pk}/").content.decode()
    usage = page[page.index('id="usage"'):page.index("</section>", page.index('id="usage"'))]
    assert "usage-demo" in usage and ">11<" in usage and ">7<" in usage


@pytest.mark.django_db
def test_the_verdict_lists_every_backend_the_default_first_with_why(node, operator, tiny_gguf):
    import re

    node.backends = [LLAMA_CPP_PYTHON, {"name": "llama-server", "available": True, "version": "b6500",
                                        "flavour": "cpu", "path": "/opt/llama-server", "reason": ""}]
    node.save()
    html = logged_in(operator).get("/instances/new/verdict", {"model_path": str(tiny_gguf)}).content.decode()
    rows = re.findall(r'data-backend="([\w-]+)"><strong>[\w-]+</strong>(.*?)</li>', html, re.S)
    assert [name for name, _ in rows] == ["llama-server", "llama-cpp-python", "vllm"]
    text = {name: " ".join(rest.split()) for name, rest in rows}
    assert "default" in text["llama-server"] and "GGUF on CPU-only -&gt; llama-server" in text["llama-server"]
    assert "faster than llama-cpp-python on the CPU" in text["llama-server"]  # the verdict says why
    assert "can run it if chosen" in text["llama-cpp-python"]
    assert "(cannot)" in text["vllm"] and "vllm cannot serve a gguf model" in text["vllm"]


def _many_instances(node, count: int) -> list:
    from serving.models import InstanceState, ModelInstance

    ModelInstance.objects.bulk_create(
        ModelInstance(model_name=f"m-{i:03}", model_path=f"gguf/m-{i:03}", backend="llama-cpp-python", node=node,
                      state=InstanceState.READY if i % 2 else InstanceState.PENDING) for i in range(count))
    return list(ModelInstance.objects.all())  # newest first


@pytest.mark.django_db
def test_the_instances_list_comes_in_pages_of_fifty_newest_first(node, viewer):
    from serving.web.live import INSTANCES_PAGE

    newest_first = _many_instances(node, 2 * INSTANCES_PAGE + 20)
    c = logged_in(viewer)
    first = c.get("/instances/").content.decode()
    assert first.count('<tr id="inst-row-') == INSTANCES_PAGE
    assert f'id="inst-row-{newest_first[0].pk}"' in first and f'id="inst-row-{newest_first[50].pk}"' not in first
    assert "page 1 of 3 · 1–50 of 120 instances" in first and '?page=2">Older' in first and "Newer" not in first
    assert '<div id="instances-card"' in first and 'ws-connect="/ws/instances/"' in first
    assert "60 ready of 120 active" in first  # the count is of every instance, not the page's
    last = c.get("/instances/?page=3").content.decode()
    assert last.count('<tr id="inst-row-') == 20 and f'id="inst-row-{newest_first[-1].pk}"' in last
    assert "page 3 of 3 · 101–120 of 120 instances" in last and '?page=2">← Newer' in last and "Older" not in last
    # Page 1's card is the one the websocket pushes: a later page keeps its own id and socket.
    assert '<div id="instances-card-p3"' in last and 'ws-connect="/ws/instances/?page=3"' in last
    assert 'hx-get="/instances/?page=3"' in last  # the catch-up after a reconnect fetches this page
    for odd in ("99", "0", "-1", "abc", "²", "1" * 40):
        r = c.get("/instances/", {"page": odd})
        assert r.status_code == 200, odd
    assert "page 3 of 3" in c.get("/instances/?page=99").content.decode()
    assert "page 1 of 3" in c.get("/instances/?page=abc").content.decode()


@pytest.mark.django_db(transaction=True)
async def test_a_later_page_gets_its_rows_states_and_the_count_but_not_page_one(node, viewer):
    from serving.web.consumers import InstancesConsumer

    newest_first = await sync_to_async(_many_instances)(node, 60)
    oldest = newest_first[-1]
    sockets = {}
    for page in ("", "?page=2"):
        ws = WebsocketCommunicator(InstancesConsumer.as_asgi(), f"/ws/instances/{page}")
        ws.scope["user"] = viewer.user
        ws.scope["query_string"] = page.lstrip("?").encode()
        assert (await ws.connect())[0]
        sockets[page] = ws
    try:
        await sync_to_async(lambda: oldest.mark_caching(30.0))()
        first = await sockets[""].receive_from(timeout=3)
        second = ""
        while "ready-count" not in second or "inst-row-state" not in second:  # one flush or more
            second += await sockets["?page=2"].receive_from(timeout=3)
    finally:
        for ws in sockets.values():
            await ws.disconnect()
    assert first.startswith('<div id="instances-card"') and f'id="inst-row-{oldest.pk}"' not in first
    assert "instances-card" not in second
    assert f'<div id="inst-row-state-{oldest.pk}"' in second and "CACHING 30%" in second
    assert 'id="ready-count" hx-swap-oob="true">30 ready of 60 active' in second
