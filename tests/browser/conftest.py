"""Playwright (sync API) driving Debian's Chromium against a real console process."""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.procs import SESSION_CHILDREN, children_of

CHROMIUM = os.environ.get("XGEN_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
]


@pytest.fixture(scope="session")
def playwright_browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    before = {pid for pid, _ in children_of(os.getpid())}
    with sync_playwright() as pw:
        # The Playwright driver is a session-long child on purpose.
        SESSION_CHILDREN.update(pid for pid, _ in children_of(os.getpid()) if pid not in before)
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(playwright_browser) -> Iterator[object]:
    context = playwright_browser.new_context(viewport={"width": 1360, "height": 900})
    context.set_default_timeout(20_000)
    pg = context.new_page()
    yield pg
    context.close()


def login(page, base_url: str, username: str, password: str) -> None:
    page.goto(f"{base_url}/accounts/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
