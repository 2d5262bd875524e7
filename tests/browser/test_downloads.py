"""A download from the browser: the form, a live progress bar to 100 %, the model in the browser."""
from __future__ import annotations

import os
import re

import pytest

from tests.browser.conftest import login
from tests.conftest import start_console
from tests.hub.fake_hf import FakeHub
from tests.procs import stop_process

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def fake_hub():
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": os.urandom(3_000_000),
             "tokenizer.json": b"{}"}
    hub = FakeHub({"acme/browser-model": files}, delay_per_chunk=0.05, chunk=32 * 1024).start()
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def hub_console(tmp_path_factory, fake_hub):
    console = start_console(tmp_path_factory.mktemp("console-dl"), extra_env={"HF_ENDPOINT": fake_hub.url})
    yield console
    assert stop_process(console.proc, timeout=30) == 0, console.log[-3000:]


def test_a_download_shows_live_progress_and_lands_in_the_models_page(hub_console, page):
    login(page, hub_console.url, hub_console.admin_user, hub_console.admin_password)
    page.wait_for_url(lambda url: "/accounts/login/" not in url)
    page.goto(f"{hub_console.url}/downloads/")
    page.fill("#repo_id", "acme/browser-model")
    page.select_option("#dl-format", "huggingface")
    page.click("#download-form button[type=submit]")
    job = page.locator("article.job").first
    job.wait_for()
    assert "acme/browser-model" in job.locator(".job-repo").inner_text()
    # The page is never reloaded from here on: every change arrives over the websocket.
    page.wait_for_function(
        "() => { const b = document.querySelector('article.job [role=progressbar]');"
        " return b && +b.getAttribute('aria-valuenow') > 0 && +b.getAttribute('aria-valuenow') < 100; }",
        timeout=60_000)
    page.wait_for_function(
        "() => { const j = document.querySelector('article.job');"
        " return j && j.dataset.status === 'COMPLETED'; }", timeout=90_000)
    job = page.locator("article.job").first
    assert job.locator(".job-percent").inner_text() == "100 %"
    assert job.locator("[role=progressbar]").get_attribute("aria-valuenow") == "100"
    assert job.locator("table.files tbody tr").count() == 3
    page.goto(f"{hub_console.url}/models/")
    row = page.locator("tr[data-prefix='huggingface/acme_browser-model']")
    assert row.locator(".badge").inner_text() == "complete"
    assert re.search(r"2\.\d\s+MB", row.inner_text())
    assert row.get_by_role("link", name="Load").get_attribute("href") == \
        "/instances/new/?model_path=huggingface/acme_browser-model"


def test_an_unknown_repo_shows_why_and_cancel_works(hub_console, page, fake_hub):
    login(page, hub_console.url, hub_console.admin_user, hub_console.admin_password)
    page.wait_for_url(lambda url: "/accounts/login/" not in url)
    page.goto(f"{hub_console.url}/downloads/")
    page.fill("#repo_id", "nobody/missing")
    page.click("#download-form button[type=submit]")
    page.wait_for_function(
        "() => { const j = document.querySelector('article.job'); return j && j.dataset.status === 'FAILED'; }",
        timeout=60_000)
    assert "Repository not found: nobody/missing" in page.locator("article.job .job-error").first.inner_text()
    # A slow download, cancelled from its button while bytes arrive.
    fake_hub.delay_per_chunk = 0.2
    try:
        page.fill("#repo_id", "acme/browser-model")
        page.fill("#revision", "main")
        page.check("#dl-replace")  # the first test may have put it in the store (else: 409 model_exists)
        page.click("#download-form button[type=submit]")
        page.wait_for_function(
            "() => { const j = document.querySelector('article.job');"
            " return j && j.dataset.status === 'DOWNLOADING' &&"
            " +j.querySelector('[role=progressbar]').getAttribute('aria-valuenow') > 0; }", timeout=60_000)
        page.locator("article.job").first.get_by_role("button", name="Cancel").click()
        page.wait_for_function(
            "() => { const j = document.querySelector('article.job'); return j && j.dataset.status === 'CANCELLED'; }",
            timeout=30_000)
    finally:
        fake_hub.delay_per_chunk = 0.05
