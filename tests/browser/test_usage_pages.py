"""The pages added for issue 14 in a real browser: Usage (charts, table, CSV, range), Requests
(search by request id), and an admin giving a key limits and reading it back in the Audit log."""
import pytest

from tests.browser.conftest import login

pytestmark = pytest.mark.browser

SEED = """
from datetime import timedelta
from django.utils import timezone
from serving.models import RequestLog, UsageBucket
hour = timezone.now().replace(minute=0, second=0, microsecond=0)
for i, (key_id, name, user, model) in enumerate([(11, "team-a", "ann", "tiny"), (12, "team-b", "bob", "embed")]):
    for h in range(3):
        UsageBucket.objects.create(bucket_start=hour - timedelta(hours=h), key_id=key_id, key_name=name, username=user,
                                   model=model, instance_id=1 + i, node="test-node", requests=10 + h, errors=h,
                                   prompt_tokens=700, completion_tokens=300, busy_seconds=60.0)
for n in range(30):
    RequestLog.objects.create(at=timezone.now() - timedelta(seconds=n), request_id=f"req-{n:03d}", key_id=11,
                              key_name="team-a", username="ann", model="tiny", instance_id=1, node="test-node",
                              status=200 if n % 5 else 429, error="" if n % 5 else "rate_limit_exceeded",
                              ttft_ms=12.5, duration_ms=80.0, prompt_tokens=7, completion_tokens=3, client="10.0.0.1")
"""


def test_a_team_lead_reads_usage_and_finds_a_request(console, page):
    console.manage("createuser", "--username", "lead", "--role", "viewer", "--password", "lead-pass-123")
    console.manage("shell", "-c", SEED)
    login(page, console.url, "lead", "lead-pass-123")
    page.get_by_role("link", name="Usage").click()
    page.wait_for_url("**/usage/")
    assert page.locator("svg.chart").count() == 5
    assert page.locator("#chart-requests-model rect").count() >= 6  # 3 hours x 2 models
    assert page.locator("#chart-tokens-who + .legend").inner_text().split() == ["team-a", "team-b"]
    row = page.locator("#usage-table tr", has_text="team-a")
    assert "33" in row.inner_text() and "2100" in row.inner_text()  # 10+11+12 requests, 3 x 700 prompt tokens
    with page.expect_download() as download:
        page.locator("#csv-export").click()
    csv = open(download.value.path()).read()
    assert csv.startswith("bucket_start,key_id,key_name") and "team-b" in csv
    page.get_by_role("link", name="last 7d").click()
    page.wait_for_url("**range=7d**")
    assert page.locator("svg.chart").count() == 5 and page.locator("#bucket").input_value() == "day"
    page.select_option("#group", "user")
    page.get_by_role("button", name="Show").click()
    page.wait_for_url("**group=user**")
    assert page.locator("#usage-table tr", has_text="bob").is_visible()

    page.get_by_role("link", name="Requests").click()
    assert page.locator("#requests-table tbody tr").count() == 30
    page.fill("#request_id", "req-005")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_function("document.querySelectorAll('#requests-table tbody tr').length === 1")
    only = page.locator("#requests-table tbody tr").inner_text()
    assert "req-005" in only and "429" in only and "rate_limit_exceeded" in only
    assert "request_id=req-005" in page.url


def test_an_admin_limits_a_key_and_reads_it_in_the_audit_log(console, page):
    login(page, console.url, console.admin_user, console.admin_password)
    page.get_by_role("link", name="API keys").click()
    form = page.locator("#new-key-form")
    form.locator("input[name=name]").fill("browser-key")
    form.locator("input[name=rpm]").fill("3")
    form.locator("input[name=allowed_models]").fill("tiny")
    form.get_by_role("button", name="Create key").click()
    assert page.locator("#new-key-value").inner_text().startswith("xgen_")
    row = page.locator("#keys-table tr", has_text="browser-key")
    assert "3 rpm" in row.inner_text() and "tiny" in row.inner_text()
    row.get_by_role("link", name="Edit").click()
    page.fill("input[name=tpm]", "1000")
    page.get_by_role("button", name="Save").click()
    assert "1000 tpm" in page.locator("#keys-table tr", has_text="browser-key").inner_text()
    page.get_by_role("link", name="Audit").click()
    page.select_option("#action", "key_change")
    page.wait_for_function("document.querySelector('#audit-table tbody').innerText.includes('browser-key')")
    change = page.locator("#audit-table tbody tr").first.inner_text()
    assert console.admin_user in change and "success" in change and "tpm" in change
    page.select_option("#action", "login")
    page.wait_for_function("document.querySelector('#audit-table tbody').innerText.includes('login')")
    assert console.admin_user in page.locator("#audit-table tbody tr").first.inner_text()
