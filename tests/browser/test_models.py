"""Upload from the page (a job the node agent runs) with live progress, browse, and delete with
confirmation (admin)."""
from __future__ import annotations

import pytest

from tests.browser.conftest import login

pytestmark = pytest.mark.browser


def test_upload_browse_and_delete(console, page, tiny_gguf):
    login(page, console.url, console.admin_user, console.admin_password)
    page.wait_for_url(lambda url: "/accounts/login/" not in url)
    page.goto(f"{console.url}/models/upload/")
    page.fill("#name", "../escape")
    page.fill("#local_path", str(tiny_gguf))
    page.click("#upload-form button[type=submit]")
    assert "Invalid model name" in page.locator(".messages").inner_text()
    page.fill("#name", "page-upload")
    page.fill("#local_path", str(tiny_gguf))
    page.click("#upload-form button[type=submit]")
    row = page.locator("article.upload").first
    page.wait_for_function("() => document.querySelector('article.upload')?.dataset.status === 'COMPLETED'",
                           timeout=30_000)
    assert row.get_attribute("data-status") == "COMPLETED"
    assert row.locator("[role=progressbar]").get_attribute("aria-valuenow") == "100"
    row.get_by_role("link", name="See it in Models").click()
    model = page.locator("tr[data-prefix='gguf/page-upload']")
    assert model.locator(".badge").inner_text() == "complete"
    # The same name again is refused (409) unless asked to replace it; the model stays as it is.
    page.goto(f"{console.url}/models/upload/")
    page.fill("#name", "page-upload")
    page.fill("#local_path", str(tiny_gguf))
    page.click("#upload-form button[type=submit]")
    assert "already a complete model" in page.locator(".messages").inner_text()
    assert page.locator("article.upload").count() == 1
    # Search and format filter narrow the list without a reload.
    page.goto(f"{console.url}/models/")
    page.select_option("#format", "huggingface")
    page.wait_for_function("() => !document.querySelector(\"tr[data-prefix='gguf/page-upload']\")")
    page.select_option("#format", "")
    page.fill("#q", "page-up")
    model.wait_for()
    model.get_by_role("button", name="Delete").click()
    dialog = page.locator("dialog#confirm-delete")
    assert "gguf/page-upload" in dialog.inner_text()
    dialog.get_by_role("button", name="Keep it").click()
    assert model.is_visible()
    model.get_by_role("button", name="Delete").click()
    dialog.get_by_role("button", name="Delete").click()
    assert "Deleted gguf/page-upload" in page.locator(".messages").inner_text()
    assert page.locator("tr[data-prefix='gguf/page-upload']").count() == 0


def test_an_upload_made_while_the_page_is_disconnected_shows_on_reconnect(console, page, tiny_gguf):
    """The page's websockets are held (they never reach the server), so an upload started and
    ended through the API never reaches the page; once the socket drops and htmx connects again,
    the page catches up on open (it did only when a hidden tab came back: a job that ended before
    the page's socket joined showed RUNNING for good; CI saw it once)."""
    import re
    import time

    held, release = [], []

    def route(ws):
        if release:
            ws.connect_to_server()
        else:
            held.append(ws)  # mocked: the page sees it open, the server never does

    page.route_web_socket(re.compile(r"/ws/uploads/$"), route)
    login(page, console.url, console.admin_user, console.admin_password)
    page.wait_for_url(lambda url: "/accounts/login/" not in url)
    page.goto(f"{console.url}/models/upload/")
    # The (mocked) socket is open and the page's catch-up on opening it is done: from here on only
    # a new connection can bring the page anything.
    page.locator("#live-indicator:not(.down)").wait_for(state="visible")
    page.wait_for_load_state("networkidle")
    csrf = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
    answer = page.request.post(f"{console.url}/api/storage/upload", headers={"X-CSRFToken": csrf},
                               data={"local_path": str(tiny_gguf), "format": "gguf", "name": "late-page"})
    assert answer.status == 202, answer.text()
    job_id = answer.json()["id"]
    deadline = time.monotonic() + 30
    while page.request.get(f"{console.url}/api/storage/uploads/{job_id}").json()["status"] != "COMPLETED":
        assert time.monotonic() < deadline, "the upload did not complete"
        time.sleep(0.2)
    assert page.locator(f"#upload-{job_id}").count() == 0  # nothing reached the page
    release.append(True)
    held[-1].close(code=1012)  # the page's socket drops ("service restart"); htmx connects again
    page.wait_for_function(f"() => document.querySelector('#upload-{job_id}')?.dataset.status === 'COMPLETED'",
                           timeout=30_000)
