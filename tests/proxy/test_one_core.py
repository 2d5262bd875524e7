"""Every caller reaching a backend from Django goes through the proxy core (issue 23 item 3,
issue 24 item 1): the Ninja mirror of the inference routes and the server-side playground are
admitted, queued (max_concurrency), alias-rewritten, counted and logged like /v1/. Before, the
mirror called the upstream client itself (no queue, no alias rewrite) and the playground posted
straight to the backend with httpx (no queue, no usage, no request log)."""
from __future__ import annotations

import asyncio
import json

import pytest
from django.test import AsyncClient, Client

CHAT = {"model": "echo-alias", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def one_slot_echo(transactional_db, echo_backend, settings):
    """The echo backend as a READY instance with max_concurrency 1, an alias, and no queue."""
    from django.utils import timezone

    from hardware.models import Node
    from serving.models import ModelInstance
    from serving.proxy.replicas import routing_table

    settings.QUEUE_MAX = 0
    node = Node.objects.create(name="gpu-local", address="127.0.0.1", last_heartbeat=timezone.now())
    inst = ModelInstance.objects.create(model_name="echo", aliases=["echo-alias"], model_path="/m", backend="echo",
                                        node=node, port=echo_backend.port, state="READY", ready_at=timezone.now(),
                                        max_concurrency=1)
    routing_table.invalidate()
    return inst


async def _holding_the_slot(coro):
    """Run `coro` while another request holds the model's one slot."""
    from serving.proxy import ondemand
    from serving.proxy.replicas import routing_table
    from serving.proxy.upstream import shutdown_proxy

    snap = await routing_table.refresh()
    slot = await ondemand.admit("echo", snap.by_name["echo"], 4, "key:other")
    try:
        return await coro
    finally:
        slot.release()
        await shutdown_proxy()


async def test_the_ninja_mirror_queues_and_rewrites_aliases_like_v1(one_slot_echo, viewer):
    from serving.proxy.upstream import shutdown_proxy

    auth = {"authorization": f"Bearer {viewer.key}"}
    client = AsyncClient()
    try:
        r = await client.post("/api/inference/v1/chat/completions", data=CHAT, content_type="application/json",
                              headers=auth)
        assert r.status_code == 200
        seen = json.loads(b"".join([chunk async for chunk in r.streaming_content]))
        assert seen["body"]["model"] == "echo", "the alias reaches the backend as the served name"
    finally:
        await shutdown_proxy()
    for path in ("/api/inference/v1/chat/completions", "/api/inference/v1/completions"):
        full = await _holding_the_slot(client.post(path, data={**CHAT, "prompt": "x"},
                                                   content_type="application/json", headers=auth))
        assert full.status_code == 429, (path, full.content)
        assert full.json()["error"]["code"] == "queue_full"


@pytest.fixture
def one_slot_tiny(transactional_db, llama_server, settings):
    """A real llama-cpp-python engine on the tiny model as a READY instance with max_concurrency 1."""
    from django.utils import timezone

    from hardware.models import Node
    from serving.models import ModelInstance
    from serving.proxy.replicas import routing_table

    settings.QUEUE_MAX = 0
    node = Node.objects.create(name="gpu-local", address="127.0.0.1", last_heartbeat=timezone.now())
    inst = ModelInstance.objects.create(model_name=llama_server.alias, model_path="/m", backend="llama-cpp-python",
                                        node=node, port=llama_server.port, state="READY", ready_at=timezone.now(),
                                        max_concurrency=1)
    routing_table.invalidate()
    return inst


def _signed_in(user) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    client.get("/")  # the CSRF cookie
    return client


def _playground(client: Client, pk: int, prompt: str):
    token = client.cookies["csrftoken"].value
    return client.post(f"/instances/{pk}/playground", {"prompt": prompt}, HTTP_X_CSRFTOKEN=token,
                       HTTP_HX_REQUEST="true")


def test_the_playground_goes_through_the_proxy_as_the_signed_in_user(one_slot_tiny, viewer):
    import re

    from serving.models import RequestLog
    from serving.proxy.usage import recorder

    client = _signed_in(viewer.user)
    r = _playground(client, one_slot_tiny.pk, "hello there")
    assert r.status_code == 200
    html = r.content.decode()
    assert "msg-error" not in html and 'id="reply-text"' in html, html
    shown = re.search(r"(\d+) prompt \+ (\d+) completion tokens", html)
    assert shown, html
    recorder.flush_sync()
    rows = list(RequestLog.objects.values("username", "key_id", "model", "status", "prompt_tokens",
                                          "completion_tokens"))
    assert rows == [{"username": viewer.user.username, "key_id": 0, "model": "tiny", "status": 200,
                     "prompt_tokens": int(shown[1]), "completion_tokens": int(shown[2])}], rows


def test_the_playground_waits_its_turn_in_the_queue(one_slot_tiny, viewer):
    from serving.proxy import ondemand
    from serving.proxy.replicas import routing_table

    client = _signed_in(viewer.user)

    async def hold_then_ask():
        from asgiref.sync import sync_to_async

        snap = await routing_table.refresh()
        slot = await ondemand.admit("tiny", snap.by_name["tiny"], 4, "key:other")
        try:
            return await sync_to_async(_playground)(client, one_slot_tiny.pk, "hello")
        finally:
            slot.release()

    r = asyncio.run(hold_then_ask())
    html = r.content.decode()
    assert "429" in html and "queue for" in html and "is full" in html, html
