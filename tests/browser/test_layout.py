"""Every page fits the window (1280 px and 390 px wide), loads no missing resource, has no serious or
critical accessibility violation (axe-core, tests/browser/axe.py), and is screenshotted at both
widths into the test's temp dir (screenshots/<width>/<page>.png) for a person to look at.

An instance with proxy usage makes the widest table there is (the instance page's Usage card).
Every page is also read as a person would (issue 32 #6): no label twice in one definition list
(the instance page showed Memory twice), and no chart text under 11 px as drawn, at either width
(SVG text shrinks with its chart: 5-9 px at 390 px)."""
from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.browser.axe import axe_source, serious_violations
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
            # The unload ends before the stop. A SIGTERM while the agent was still stopping it (its
            # state changes published from worker threads) once left the console's exit hung until
            # stop_process's SIGKILL (a clean-clone run, 2026-12-06): a defect of its own, in the note.
            deadline = time.monotonic() + 30
            while client.get(f"/api/management/instances/{pk}").json()["state"] != "STOPPED":
                assert time.monotonic() < deadline, c.log[-3000:]
                time.sleep(0.2)
    finally:
        code = stop_process(c.proc, timeout=30)
        assert code == 0, f"console exited with {code}:\n{c.log[-3000:]}"


# Every page a person opens (the action routes are POST-only); {pk}: the demo instance.
PAGES = ["/", "/?range=24h", "/?range=7d", "/gpus/", "/nodes/test-node/", "/nodes/test-node/cache/", "/models/",
         "/models/upload/", "/downloads/", "/instances/", "/instances/new/", "/instances/presets/", "/instances/{pk}/", "/usage/",
         "/requests/", "/keys/", "/keys/{key}/", "/users/", "/users/{user}/", "/audit/"]


# The labels (<dt>) each definition list has more than once.
REPEATED_LABELS = """() => [...document.querySelectorAll('dl')].flatMap(dl => {
    const seen = new Set(), twice = [];
    for (const dt of dl.querySelectorAll(':scope > dt')) {
        const label = dt.textContent.trim();
        if (seen.has(label)) twice.push(label);
        seen.add(label);
    }
    return twice;
})"""
# Chart text (SVG text scaled as the SVG is drawn, the HTML labels over it) smaller than 11 px on screen.
SMALL_CHART_TEXT = """() => [...document.querySelectorAll('svg text, .chart-box .tick')].map(el => {
    let px = parseFloat(getComputedStyle(el).fontSize);
    if (el instanceof SVGElement) { const m = el.getScreenCTM(); px *= Math.min(Math.abs(m.a), Math.abs(m.d)); }
    return [el.textContent.trim(), Math.round(px * 10) / 10];
}).filter(([, px]) => px < 11)"""
MIN_TEXT_PX = 11


def _name(path: str) -> str:
    return path.strip("/").replace("/", "_").replace("?range=", "range-") or "dashboard"


@pytest.mark.parametrize("width", [1280, 390])
def test_every_page_fits_is_accessible_and_is_screenshotted(served_console, playwright_browser, width,
                                                            tmp_path_factory):
    console, pk = served_console
    axe = axe_source()
    shots = tmp_path_factory.getbasetemp() / "screenshots" / str(width)
    shots.mkdir(parents=True, exist_ok=True)
    context = playwright_browser.new_context(viewport={"width": width, "height": 900})
    context.set_default_timeout(20_000)
    page = context.new_page()
    missing: list[str] = []
    page.on("response", lambda r: missing.append(f"{r.status} {r.url}") if r.status == 404 else None)
    violations: list[str] = []
    try:
        page.goto(f"{console.url}/accounts/login/")
        page.screenshot(path=str(shots / "login.png"), full_page=True)
        violations += [f"/accounts/login/: {v}" for v in serious_violations(page, axe)]
        login(page, console.url, console.admin_user, console.admin_password)
        page.wait_for_url(lambda url: "/accounts/login/" not in url)
        ids = page.evaluate("""async () => {
            const keys = await (await fetch('/api/keys')).json();
            return {key: (keys.items || keys)[0]?.id};
        }""")
        user = console.manage("shell", "-c", "from accounts.models import User; "
                              "print(User.objects.get(username='admin').pk)").stdout.strip().splitlines()[-1]
        for path in PAGES:
            url = console.url + path.format(pk=pk, key=ids.get("key"), user=user)
            response = page.goto(url)
            assert response is not None and response.status == 200, (path, response and response.status)
            page.wait_for_load_state("networkidle")
            if path == "/instances/{pk}/":
                assert page.locator("#usage .table-scroll table").count() == 1, "no usage row to measure"
            wide = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
            if wide[0] > wide[1]:  # name the elements that stick out, for whoever fixes it
                culprits = page.evaluate("""() => [...document.querySelectorAll('body *')]
                    .filter(e => e.getBoundingClientRect().right > window.innerWidth + 1)
                    .slice(-5).map(e => e.tagName + '.' + e.className + ' ' + Math.round(e.getBoundingClientRect().right))""")
                pytest.fail(f"{path} at {width} px: document {wide[0]} px wide; sticking out: {culprits}")
            page.screenshot(path=str(shots / f"{_name(path)}.png"), full_page=True)
            violations += [f"{path}: {v}" for v in serious_violations(page, axe)]
            violations += [f"{path}: the label {label!r} twice in one list" for label in page.evaluate(REPEATED_LABELS)]
            violations += [f"{path} at {width} px: chart text {text!r} drawn at {px} px (< {MIN_TEXT_PX})"
                           for text, px in page.evaluate(SMALL_CHART_TEXT)]
            if path in ("/", "/nodes/test-node/", "/usage/"):
                assert page.locator("svg text, .chart-box .tick").count(), f"{path}: no chart label measured"
        assert not missing, missing
        assert not violations, "\n".join(violations)
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
