"""In a real Chromium, as a newcomer: Models -> Load on the demo model -> watch the log stream and
READY -> chat in the playground -> Unload."""
from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from tests.browser.conftest import login
from tests.conftest import Console, start_console
from tests.procs import stop_process

pytestmark = pytest.mark.browser

STARTED = "listening on"  # llama-server's line once its HTTP server is up
CHAT_LINE = "prompt eval time"  # and one of its lines for each answer (its access log is at trace level)


@pytest.fixture(scope="module")
def demo_console(tmp_path_factory) -> Iterator[Console]:
    """A newcomer's console: the demo model on, backends as the node's own probe finds them."""
    c = start_console(tmp_path_factory.mktemp("demo-console"), extra_env={"XGEN_DEMO_MODEL": "true"})
    yield c
    code = stop_process(c.proc, timeout=30)
    assert code == 0, f"console exited with {code}:\n{c.log[-3000:]}"


def test_load_watch_chat_unload(demo_console, page):
    console = demo_console
    login(page, console.url, console.admin_user, console.admin_password)
    row = page.locator("tr", has_text="gguf/xgen-tiny-demo")
    deadline = time.monotonic() + 30
    while True:  # the agent's first start puts the demo model in the store
        page.goto(f"{console.url}/models/")
        if row.count() or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    # An engine preset for the model (issue 27 #3), from its page: a wrong setting is refused there.
    page.goto(f"{console.url}/instances/presets/")
    page.fill("#preset-model", "gguf/xgen-tiny-demo")
    page.fill("#preset-name", "two-slots")
    page.fill("#preset-parallel", "2")
    page.select_option("#preset-kv_cache_type", "fp8")  # llama.cpp has no fp8 KV cache
    page.click("#preset-save")
    assert "no engine the nodes have can apply it" in page.locator("#preset-error").inner_text()
    page.fill("#preset-model", "gguf/xgen-tiny-demo")
    page.fill("#preset-name", "two-slots")
    page.fill("#preset-parallel", "2")
    page.check("#preset-default")
    page.click("#preset-save")
    preset_row = page.locator("#preset-table tr[data-preset=two-slots]")
    assert "default" in preset_row.inner_text() and "applies" in preset_row.inner_text()
    page.goto(f"{console.url}/models/")
    row.get_by_role("link", name="Load").click()
    assert "/instances/new/?model_path=gguf/xgen-tiny-demo" in page.url
    verdict = page.locator("#load-verdict")
    # The model's default preset is chosen; the verdict shows its flags as this engine takes them.
    assert page.locator("#id_preset").input_value() == "two-slots"
    verdict.locator("#verdict-preset").get_by_text("--parallel 2").wait_for()
    page.select_option("#id_preset", "none")
    page.wait_for_function("() => !document.querySelector('#verdict-preset')")
    page.select_option("#id_preset", "two-slots")
    verdict.locator("#verdict-preset").wait_for()
    # The node built llama-server (the setup does): the auto choice takes it on the CPU, and says why.
    verdict.locator("#verdict-backend").get_by_text("GGUF on CPU-only -> llama-server (cpu)").wait_for()
    assert "faster than llama-cpp-python on the CPU" in verdict.inner_text()
    assert "runs on the CPU of test-node" in verdict.inner_text()
    page.fill("#id_model_name", "demo-chat")
    page.fill("#id_extra_args", "--no-such-flag 1")
    page.locator("#verdict-error").get_by_text("does not accept --no-such-flag").wait_for()
    page.fill("#id_extra_args", "--n_ctx 512")  # llama-cpp-python's flag: llama-server refuses it
    page.locator("#verdict-error").get_by_text("does not accept --n_ctx").wait_for()
    page.fill("#id_extra_args", "--ctx-size 512")
    page.locator("#command-line").get_by_text("--ctx-size 512").wait_for()
    assert "--parallel 2" in page.locator("#command-line").inner_text()  # the preset's, beside the load's own
    assert "--alias demo-chat" in page.locator("#command-line").inner_text()
    page.click("#load-submit")
    page.wait_for_url(re.compile(r"/instances/\d+/$"))
    page.locator("#live-indicator:not([hidden])").wait_for()
    page.locator("[data-state=READY]").wait_for(timeout=60_000)
    assert "two-slots" in page.locator("#inst-preset").inner_text()
    timeline = page.locator("#timeline").inner_text()
    for state in ("PENDING", "CACHING", "LOADING", "WARMING", "READY"):
        assert state in timeline
    page.locator("#log .line", has_text=STARTED).first.wait_for()

    # Reading up pauses the follow; new lines then do not yank the view back down. llama-server's
    # log at READY is short (16-22 lines, about the 360 px box: a clean CI run met one that fit, so
    # there was nothing to scroll up to): the box is made 120 px high here, so it overflows.
    page.locator("#log").evaluate("el => { el.style.height = '120px'; el.scrollTop = el.scrollHeight; }")
    page.wait_for_function("() => { const el = document.getElementById('log');"
                           " return el.scrollHeight - el.clientHeight > 48; }")
    lines_before = page.locator("#log .line").count()
    page.locator("#log").evaluate("el => { el.scrollTop = 0; el.dispatchEvent(new Event('scroll')); }")
    page.locator("#log-follow").get_by_text("paused").wait_for()
    page.fill("#prompt", "hello there")
    page.click("#pg-send")
    page.locator(".pg-assistant[data-done=true]").wait_for(timeout=60_000)
    assert "tokens" in page.locator(".pg-assistant .pg-stats").inner_text()
    # The backend's lines for that chat (llama-server's timings) stream into the open page.
    page.wait_for_function(f"document.querySelectorAll('#log .line').length > {lines_before}")
    assert page.locator("#log .line").count() > lines_before
    assert page.locator("#log").evaluate("el => el.scrollTop") == 0
    page.locator("#log").evaluate("el => { el.scrollTop = el.scrollHeight; el.dispatchEvent(new Event('scroll')); }")
    page.locator("#log-follow").get_by_text("following").wait_for()

    page.fill("#log-filter", CHAT_LINE)
    visible = page.locator("#log .line:visible")
    assert visible.count() >= 1 and all(CHAT_LINE in t for t in visible.all_inner_texts())
    page.fill("#log-filter", "")

    with page.expect_download() as dl:
        page.get_by_role("button", name="Download log").click()
    assert STARTED in open(dl.value.path()).read()

    page.click("#unload-btn")
    page.locator("[data-state=STOPPED]").wait_for(timeout=30_000)
    page.goto(f"{console.url}/instances/")
    listed = page.locator("tr", has_text="demo-chat")
    assert listed.locator("[data-state=STOPPED]").count() == 1
    # The list page is live too: Start brings the row to READY and the count along, without a reload.
    page.locator("#live-indicator:not([hidden])").wait_for()
    listed.get_by_role("button", name="Start").click()
    page.locator("#action-msg").get_by_text("Restart of demo-chat requested").wait_for()
    listed.locator("[data-state=READY]").wait_for(timeout=60_000)
    page.locator("#ready-count").get_by_text("1 ready of 1 active").wait_for()
    page.once("dialog", lambda dialog: dialog.accept())
    listed.get_by_role("button", name="Unload").click()
    listed.locator("[data-state=STOPPED]").wait_for(timeout=30_000)
    page.locator("#ready-count").get_by_text("0 ready of 0 active").wait_for()


def test_lora_adapters_from_the_dialog_and_the_instance_page(demo_console, page, tiny_gguf, tmp_path):
    """Issue 27 #1: an adapter given in the Load dialog is served as <model>:<adapter>; the
    instance page lists it, and removing or adding one there restarts llama-server with the new
    set (it loads adapters at start), which the page says."""
    import httpx

    from hub.demo import write_tiny_lora_gguf

    console = demo_console
    lora = write_tiny_lora_gguf(tmp_path / "pirate.gguf")
    login(page, console.url, console.admin_user, console.admin_password)
    page.goto(f"{console.url}/instances/new/?model_path={tiny_gguf}")
    page.fill("#id_model_name", "tiny-lora")
    page.fill("#id_adapters", f"pirate {lora} 0.5")
    page.locator("#command-line").get_by_text("--lora-scaled").wait_for()
    assert f"{lora}:0.5" in page.locator("#command-line").inner_text()
    page.click("#load-submit")
    page.wait_for_url(re.compile(r"/instances/\d+/$"))
    page.locator("[data-state=READY]").wait_for(timeout=60_000)
    row = page.locator("#adapters tr[data-adapter=pirate]")
    assert "tiny-lora:pirate" in row.inner_text()
    assert "restarts the replicas one at a time" in page.locator("#adapters").inner_text()
    key = console.manage("createapikey", "--username", console.admin_user).stdout.strip().splitlines()[-1]
    models = httpx.get(f"{console.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
    assert "tiny-lora:pirate" in {m["id"] for m in models["data"]}

    row.get_by_role("button", name="Remove").click()
    page.locator("#action-msg").get_by_text("restart one at a time with the new set").wait_for()
    deadline = time.monotonic() + 90
    while True:  # the rolling restart: the replica restarts without the adapter, READY again
        page.reload()
        if page.locator("#no-adapters").count() and page.locator("[data-state=READY]").count():
            break
        assert time.monotonic() < deadline, page.locator("#timeline").inner_text()[-2000:]
        time.sleep(1)
    assert "adapters changed (removed tiny-lora:pirate)" in page.locator("#timeline").inner_text()
    models = httpx.get(f"{console.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
    assert "tiny-lora:pirate" not in {m["id"] for m in models["data"]}
    page.fill("#adapter-name", "bad name")
    page.fill("#adapter-path", str(lora))
    page.evaluate("document.querySelector('#adapter-name').removeAttribute('pattern')")  # the server's own check
    page.click("#adapter-add")
    page.locator("#action-msg").get_by_text("may use a-z 0-9").wait_for()
    page.click("#unload-btn")
    page.locator("[data-state=STOPPED]").wait_for(timeout=30_000)


def test_an_adapter_from_the_store_added_in_the_load_dialog(demo_console, page, tiny_gguf):
    """Issue 27 #1: a model and its LoRA adapter, both in the store; "Add" beside the adapter in
    the Load dialog writes its line, the command shows the slot the node fills in with its cached
    copy, and the adapter is served once READY."""
    import httpx

    from hub.demo import write_tiny_lora_gguf

    console = demo_console
    lora = write_tiny_lora_gguf(tiny_gguf.parent / "store-pirate.gguf")
    for path, fmt, name in ((tiny_gguf, "gguf", "tiny-st"), (lora, "lora", "pirate")):
        done = console.manage("hub_upload", str(path), "--format", fmt, "--name", name)
        assert done.returncode == 0, done.stdout + done.stderr
    login(page, console.url, console.admin_user, console.admin_password)
    page.goto(f"{console.url}/models/?format=lora")
    assert "loads with its base" in page.locator("tr[data-prefix='lora/pirate']").inner_text()
    page.goto(f"{console.url}/instances/new/?model_path=gguf/tiny-st")
    page.fill("#id_model_name", "tiny-st")
    page.select_option("#id_backend", "llama-server")
    page.get_by_role("button", name="Add lora/pirate to the adapters").click()
    assert page.input_value("#id_adapters") == "pirate lora/pirate 1.0\n"
    page.get_by_role("button", name="Add lora/pirate to the adapters").click()  # once only
    assert page.input_value("#id_adapters") == "pirate lora/pirate 1.0\n"
    page.locator("#command-line").get_by_text("{adapter:pirate}:1").wait_for()
    page.click("#load-submit")
    page.wait_for_url(re.compile(r"/instances/\d+/$"))
    page.locator("[data-state=READY]").wait_for(timeout=60_000)
    assert "lora/pirate" in page.locator("#adapters tr[data-adapter=pirate]").inner_text()
    key = console.manage("createapikey", "--username", console.admin_user).stdout.strip().splitlines()[-1]
    models = httpx.get(f"{console.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
    assert "tiny-st:pirate" in {m["id"] for m in models["data"]}
    page.click("#unload-btn")
    page.locator("[data-state=STOPPED]").wait_for(timeout=30_000)
