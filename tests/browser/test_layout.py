"""Every main page fits the window (1280 px and 390 px wide) and loads no missing resource.

An instance with proxy usage makes the widest table there is (the instance page's Usage card)."""
from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.browser.conftest import login
from tests.conftest import Console, start_console
from tests.procs import stop_process

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def served_console(tmp_path_factory) -> Iterator[tuple[Console, int]]:
    """A console with the demo model READY and one chat request through the proxy."""
    c = start_console(tmp_path_factory.mktemp("layout-console"), extra_env={"XGEN_DEMO_MODEL": "true"})
    try:
        key = c.manage("createapikey", "--username", "admin").stdout.strip().splitlines()[-1]
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=c.url, headers=auth, timeout=30) as client:
            deadline = time.monotonic() + 60
            while True:  # the agent's first start puts the demo model in the store
                r = client.post("/api/management/load", json={
                    "model_path": "gguf/xgen-tiny-demo", "model_name": "a-rather-long-served-model-name-for-layout"})
                if r.status_code == 202 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert r.status_code == 202, r.text
            pk = r.json()["id"]
            deadline = time.monotonic() + 90
            while client.get(f"/api/management/instances/{pk}").json()["state"] != "READY":
                assert time.monotonic() < deadline, c.log[-3000:]
                time.sleep(0.5)
            reply = client.post("/v1/chat/completions", json={
                "model": "a-rather-long-served-model-name-for-layout",
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert reply.status_code == 200, reply.text
            yield c, pk
            client.post("/api/management/unload", json={"id": pk})
    finally:
        code = stop_process(c.proc, timeout=30)
        assert code == 0, f"console exited with {code}:\n{c.log[-3000:]}"


PAGES = ["/", "/gpus/", "/models/", "/downloads/", "/models/upload/", "/instances/", "/instances/{pk}/",
         "/users/", "/keys/", "/nodes/test-node/"]


@pytest.mark.parametrize("width", [1280, 390])
def test_no_page_is_wider_than_the_window_or_misses_a_resource(served_console, playwright_browser, width):
    console, pk = served_console
    context = playwright_browser.new_context(viewport={"width": width, "height": 900})
    context.set_default_timeout(20_000)
    page = context.new_page()
    missing: list[str] = []
    page.on("response", lambda r: missing.append(f"{r.status} {r.url}") if r.status == 404 else None)
    try:
        login(page, console.url, console.admin_user, console.admin_password)
        page.wait_for_url(lambda url: "/accounts/login/" not in url)
        for path in PAGES:
            url = console.url + path.format(pk=pk)
            page.goto(url)
            page.wait_for_load_state("networkidle")
            if path == "/instances/{pk}/":
                assert page.locator("#usage .table-scroll table").count() == 1, "no usage row to measure"
            wide = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
            assert wide[0] <= wide[1], f"{path} at {width} px: document {wide[0]} px wide"
        assert not missing, missing
    finally:
        context.close()


def test_the_node_page_shows_the_cache_and_verify_runs_on_the_agent(served_console, page):
    console, pk = served_console
    login(page, console.url, console.admin_user, console.admin_password)
    page.goto(f"{console.url}/nodes/test-node/")
    row = page.locator("#node-cache tr[data-prefix='gguf/xgen-tiny-demo']")
    row.wait_for()  # fetched by htmx from the hub's view
    assert "a-rather-long-served-model-name-for-layout" in row.inner_text()  # the instance that uses it
    assert row.get_by_role("button", name="Evict").is_disabled()
    assert "not yet" in row.locator(".verify").inner_text()
    row.get_by_role("button", name="Verify").click()
    # The node's agent claims the job, hashes the files, and the polling card shows the outcome.
    page.locator("#node-cache tr[data-prefix='gguf/xgen-tiny-demo'] .verify", has_text="yes").wait_for(timeout=30_000)
    assert "free of" in page.locator("#node-cache .cache-disk").inner_text()
