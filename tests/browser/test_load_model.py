"""In a real Chromium: Models -> Load -> watch the log stream and READY -> chat -> Unload."""
from __future__ import annotations

import json
import re
import time

import pytest

from tests.browser.conftest import login
from tests.serving.conftest import LLAMA_CPP_PYTHON

pytestmark = pytest.mark.browser


def _prepare(console, tiny_gguf) -> None:
    """The node's backends as the probe reports them, and the tiny model in the store and its index."""
    code = (
        "import json; from pathlib import Path; from hardware.models import Node; from hub.models import ModelArtifact; "
        "from hub.store import get_store; "
        f"n = Node.objects.filter(name='test-node').update(backends=json.loads({json.dumps([LLAMA_CPP_PYTHON])!r})); "
        f"get_store().upload_model('gguf/xgen-tiny-demo', Path({str(tiny_gguf)!r})); "
        "ModelArtifact.objects.update_or_create(prefix='gguf/xgen-tiny-demo', defaults=dict(format='gguf', "
        f"name='xgen-tiny-demo', complete=True, size_bytes={tiny_gguf.stat().st_size}, file_count=1)); print(n)"
    )
    deadline = time.monotonic() + 30
    while (done := console.manage("shell", "-v", "0", "-c", code, check=False)).stdout.strip() != "1":
        assert time.monotonic() < deadline, f"the node never registered: {done.stdout[-500:]} {done.stderr[-2000:]}"
        time.sleep(0.2)


def test_load_watch_chat_unload(console, page, tiny_gguf):
    _prepare(console, tiny_gguf)
    login(page, console.url, console.admin_user, console.admin_password)
    page.goto(f"{console.url}/models/")
    row = page.locator("tr", has_text="gguf/xgen-tiny-demo")
    row.get_by_role("link", name="Load").click()
    assert "/instances/new/?model_path=gguf/xgen-tiny-demo" in page.url
    verdict = page.locator("#load-verdict")
    verdict.get_by_text("GGUF on CPU-only -> llama-cpp-python (cpu)").wait_for()
    assert "runs on the CPU of test-node" in verdict.inner_text()
    page.fill("#id_model_name", "demo-chat")
    page.fill("#id_extra_args", "--no-such-flag 1")
    page.locator("#verdict-error").get_by_text("does not accept --no-such-flag").wait_for()
    page.fill("#id_extra_args", "--n_ctx 512")
    page.locator("#command-line").get_by_text("--n_ctx 512").wait_for()
    assert "--model_alias demo-chat" in page.locator("#command-line").inner_text()
    page.click("#load-submit")
    page.wait_for_url(re.compile(r"/instances/\d+/$"))
    page.locator("#live-indicator:not([hidden])").wait_for()
    page.locator("[data-state=READY]").wait_for(timeout=60_000)
    timeline = page.locator("#timeline").inner_text()
    for state in ("PENDING", "CACHING", "LOADING", "WARMING", "READY"):
        assert state in timeline
    page.locator("#log .line", has_text="Uvicorn running on").first.wait_for()
    lines_before = page.locator("#log .line").count()

    # Reading up pauses the follow; new lines then do not yank the view back down.
    page.locator("#log").evaluate("el => { el.scrollTop = 0; el.dispatchEvent(new Event('scroll')); }")
    page.locator("#log-follow").get_by_text("paused").wait_for()
    page.fill("#prompt", "hello there")
    page.click("#playground-form button[type=submit]")
    page.locator("#reply-text").wait_for()
    assert "completion tokens" in page.locator("#playground-reply").inner_text()
    # The backend's access-log line for that chat streams into the open page.
    page.wait_for_function(f"document.querySelectorAll('#log .line').length > {lines_before}")
    assert page.locator("#log .line").count() > lines_before
    assert page.locator("#log").evaluate("el => el.scrollTop") == 0
    page.locator("#log").evaluate("el => { el.scrollTop = el.scrollHeight; el.dispatchEvent(new Event('scroll')); }")
    page.locator("#log-follow").get_by_text("following").wait_for()

    page.fill("#log-filter", "chat/completions")
    visible = page.locator("#log .line:visible")
    assert visible.count() >= 1 and all("chat/completions" in t for t in visible.all_inner_texts())
    page.fill("#log-filter", "")

    with page.expect_download() as dl:
        page.get_by_role("button", name="Download log").click()
    assert "Uvicorn running on" in open(dl.value.path()).read()

    page.click("#unload-btn")
    page.locator("[data-state=STOPPED]").wait_for(timeout=30_000)
    page.goto(f"{console.url}/instances/")
    assert page.locator("tr", has_text="demo-chat").locator("[data-state=STOPPED]").count() == 1
