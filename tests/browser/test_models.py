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
