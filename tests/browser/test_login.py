import pytest

from tests.browser.conftest import login

pytestmark = pytest.mark.browser


def test_admin_logs_in_and_sees_the_navigation(console, page):
    page.goto(f"{console.url}/gpus/")
    assert "/accounts/login/" in page.url
    login(page, console.url, "admin", "wrong-password")
    assert page.locator("[role=alert]").inner_text().startswith("That username and password do not match")
    login(page, console.url, console.admin_user, console.admin_password)
    nav = page.locator("nav.mainnav")
    for label in ("Models", "Instances", "GPUs", "Downloads", "API keys", "Users"):
        assert nav.get_by_role("link", name=label).is_visible()
    assert page.locator(".whoami .role-tag").inner_text() == "admin"
    page.get_by_role("link", name="API keys").click()
    page.fill("input[name=name]", "browser-key")
    page.click("text=Create key")
    key = page.locator("#new-key-value").inner_text()
    assert key.startswith("xgen_")
    page.reload()
    assert page.locator("#new-key-value").count() == 0
