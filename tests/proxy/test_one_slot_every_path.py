"""A model with max_concurrency 1 never sees two requests at once, whichever mix of paths calls it
(issue 24 item 1): /v1/chat/completions and /v1/completions on the proxy's ASGI app, the Anthropic
Messages route (translated to chat completions for a llama-cpp-python backend), the Ninja mirror
under /api/inference/, and the server-side playground as the signed-in user, all at once in one
process. The backend is a stand-in that counts the requests it holds at the same time; each one
takes 0.2 s, so two let in together would overlap for certain."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from django.test import AsyncClient, Client

from tests.proxy.conftest import AiohttpBackend

MODEL = "one-slot"
HOLD_S = 0.2


class CountingBackend(AiohttpBackend):
    """Answers chat and text completions after HOLD_S, counting how many it holds at once."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.most = 0
        self.paths: list[str] = []
        super().__init__()

    def add_routes(self, app) -> None:
        from aiohttp import web

        async def answer(request: web.Request) -> web.Response:
            await request.read()
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            self.paths.append(request.path)
            try:
                await asyncio.sleep(HOLD_S)
            finally:
                self.in_flight -= 1
            usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
            if request.path == "/v1/completions":
                return web.json_response({"object": "text_completion", "model": MODEL, "usage": usage,
                                          "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})
            return web.json_response({"id": "c1", "object": "chat.completion", "model": MODEL, "usage": usage,
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": "ok"}}]})

        app.router.add_post("/v1/chat/completions", answer)
        app.router.add_post("/v1/completions", answer)


@pytest.fixture(scope="module")
def counting_backend() -> Iterator[CountingBackend]:
    backend = CountingBackend()
    yield backend
    backend.stop()


@pytest.fixture
def one_slot(transactional_db, counting_backend, settings):
    from django.utils import timezone

    from hardware.models import Node
    from serving.models import ModelInstance
    from serving.proxy.replicas import routing_table

    settings.QUEUE_MAX = 32
    settings.QUEUE_TIMEOUT_S = 60
    node = Node.objects.create(name="gpu-local", address="127.0.0.1", last_heartbeat=timezone.now())
    inst = ModelInstance.objects.create(model_name=MODEL, model_path="/m", backend="llama-cpp-python", node=node,
                                        port=counting_backend.port, state="READY", ready_at=timezone.now(),
                                        max_concurrency=1)
    routing_table.invalidate()
    return inst


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MESSAGES = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def test_max_concurrency_1_holds_across_every_path_at_once(one_slot, counting_backend, viewer):
    from asgiref.sync import sync_to_async

    from serving.proxy.app import proxy_app
    from serving.proxy.upstream import shutdown_proxy

    browser = Client(enforce_csrf_checks=True)
    browser.force_login(viewer.user)
    browser.get("/")  # the CSRF cookie
    token = browser.cookies["csrftoken"].value
    auth = {"authorization": f"Bearer {viewer.key}"}

    def playground():
        return browser.post(f"/instances/{one_slot.pk}/playground", {"prompt": "hello"},
                            HTTP_X_CSRFTOKEN=token, HTTP_HX_REQUEST="true")

    async def everything():
        mirror = AsyncClient()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy_app), base_url="http://console",
                                         timeout=60) as direct:
                calls = []
                for _ in range(2):
                    calls += [
                        direct.post("/v1/chat/completions", json=CHAT, headers=auth),
                        direct.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
                                    headers=auth),
                        direct.post("/v1/messages", json=MESSAGES, headers={"x-api-key": viewer.key}),
                        mirror.post("/api/inference/v1/chat/completions", data=CHAT,
                                    content_type="application/json", headers=auth),
                        mirror.post("/api/inference/v1/messages", data=MESSAGES, content_type="application/json",
                                    headers=auth),
                        sync_to_async(playground, thread_sensitive=False)(),
                    ]
                return await asyncio.gather(*calls)
        finally:
            await shutdown_proxy()

    answers = asyncio.run(everything())
    statuses = [a.status_code for a in answers]
    assert statuses == [200] * len(answers), [(a.status_code, a.content[:300]) for a in answers]
    for a in answers[5::6]:  # the playground's answers: the reply, no error
        html = a.content.decode()
        assert "msg-error" not in html and 'id="reply-text"' in html, html
    assert len(counting_backend.paths) == len(answers), counting_backend.paths
    assert set(counting_backend.paths) == {"/v1/chat/completions", "/v1/completions"}
    assert counting_backend.most == 1, f"the backend held {counting_backend.most} requests at once"
