"""Sign-in through a real OpenID provider in the browser (issue 26): the login page's "Sign in with
..." button, the provider's own login and consent pages (the npm package oidc-provider,
tests/identity), and back on the console's dashboard with the role the groups map to."""
from __future__ import annotations

import pytest

from tests.browser.axe import axe_source, serious_violations
from tests.conftest import start_console
from tests.identity.conftest import CLIENT_ID, CLIENT_SECRET, OidcProvider, signing_key
from tests.procs import free_port, stop_process

pytestmark = pytest.mark.browser


def test_a_user_signs_in_through_the_provider_and_lands_with_the_mapped_role(page, tmp_path):
    provider = OidcProvider(port=free_port(), workdir=tmp_path, keys=[signing_key("key-1")],
                            accounts={"olga": {"groups": ["xgen-ops"]}})
    console = start_console(tmp_path / "console", extra_env={
        "XGEN_OIDC_ISSUER": provider.issuer, "XGEN_OIDC_CLIENT_ID": CLIENT_ID,
        "XGEN_OIDC_CLIENT_SECRET": CLIENT_SECRET, "XGEN_OIDC_SCOPES": "openid profile email groups",
        "XGEN_OIDC_NAME": "Example IdP", "XGEN_SSO_GROUP_ROLES": "xgen-ops=operator",
    })
    try:
        provider.callback = f"{console.url}/accounts/oidc/callback/"
        provider.start()
        page.goto(f"{console.url}/models/")
        assert "/accounts/login/" in page.url
        assert serious_violations(page, axe_source()) == []  # the page with the provider's button
        page.get_by_role("link", name="Sign in with Example IdP").click()
        page.wait_for_url(f"{provider.issuer}/interaction/**")
        page.fill("input[name=login]", "olga")
        page.fill("input[name=password]", "any")
        page.click("button[type=submit]")
        page.get_by_role("button", name="Continue").click()  # the provider's consent page
        page.wait_for_url(f"{console.url}/models/")  # the page asked for at first
        assert page.locator(".whoami .user").inner_text() == "olga"
        assert page.locator(".whoami .role-tag").inner_text() == "operator"
        audit = console.manage("shell", "-v", "0", "-c", "from accounts.models import AuditEvent as A; "
                               "print(sorted(A.objects.filter(target='olga').values_list('action', flat=True)))")
        assert audit.stdout.strip() == "['login', 'sso_sync']"
    finally:
        provider.stop()
        code = stop_process(console.proc, timeout=30)
        assert code == 0, console.log[-3000:]
