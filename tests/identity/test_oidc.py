"""OpenID Connect sign-in (issue 26 #1, #3) against a real provider (the npm package oidc-provider,
started by the tests): the authorization code flow through its login and consent pages, the ID
token's checks (a changed payload, another audience, expired, a replayed state, a rotated signing
key), groups -> roles, and a session the provider stops accepting."""
from __future__ import annotations

import time

import pytest
from django.test import Client

from accounts.models import ApiKey, AuditEvent, User
from tests.identity.conftest import CLIENT_ID, CLIENT_SECRET, local_path, signing_key

pytestmark = pytest.mark.django_db


@pytest.fixture
def sso(settings, oidc_provider):
    settings.OIDC_ISSUER = oidc_provider.issuer
    settings.OIDC_CLIENT_ID = CLIENT_ID
    settings.OIDC_CLIENT_SECRET = CLIENT_SECRET
    settings.OIDC_SCOPES = "openid profile email groups"
    settings.OIDC_NAME = "Example IdP"
    settings.OIDC_CLOCK_SKEW_S = 0
    settings.SSO_GROUP_ROLES = "xgen-admins=admin,xgen-ops=operator"
    settings.SSO_RECHECK_S = 300
    oidc_provider.next_id_token(mode=None)
    return oidc_provider


def provider_redirect(client: Client) -> str:
    """The console's answer to "Sign in with ...": a redirect to the provider, with PKCE."""
    resp = client.get("/accounts/oidc/login/")
    assert resp.status_code == 302, resp.content[:500]
    url = resp["Location"]
    assert "code_challenge_method=S256" in url and "code_challenge=" in url and "nonce=" in url and "state=" in url
    return url


def sign_in(client: Client, provider, login: str):
    callback = provider.authorize(provider_redirect(client), login)
    return client.get(local_path(callback)), callback


def test_the_login_page_offers_the_provider_beside_the_password_form(client, sso):
    page = client.get("/accounts/login/").content.decode()
    assert "Sign in with Example IdP" in page and 'href="/accounts/oidc/login/"' in page
    assert 'name="password"' in page and "Break-glass" not in page


def test_sign_in_through_the_provider_lands_on_the_dashboard_with_the_mapped_role(client, sso):
    sso.set_account("olivia", groups=["xgen-ops", "unrelated"])
    resp, _ = sign_in(client, sso, "olivia")
    assert resp.status_code == 302 and resp["Location"] == "/"
    dashboard = client.get("/")
    assert dashboard.status_code == 200
    user = User.objects.get(idp_source="oidc", idp_subject="olivia")
    assert (user.username, user.role, user.idp_role, user.local_role) == ("olivia", "operator", "operator", "")
    assert user.idp_groups == ["unrelated", "xgen-ops"] and not user.has_usable_password()
    assert b"olivia" in dashboard.content
    sync = AuditEvent.objects.get(action="sso_sync", target="olivia")
    assert sync.detail["to"] == "operator" and sync.detail["matched_groups"] == ["xgen-ops"]
    assert AuditEvent.objects.filter(action="login", target="olivia").exists()
    # The next sign-in with another group set moves the IdP role; a local role given meanwhile stays.
    User.objects.filter(pk=user.pk).update(local_role="operator")
    sso.set_account("olivia", groups=["xgen-admins"])
    client.logout()
    sign_in(client, sso, "olivia")
    user.refresh_from_db()
    assert (user.role, user.idp_role) == ("admin", "admin")
    sso.set_account("olivia", groups=[])
    client.logout()
    sign_in(client, sso, "olivia")
    user.refresh_from_db()
    assert (user.role, user.idp_role, user.local_role) == ("operator", "", "operator")  # the local one is kept


def test_a_missing_groups_claim_keeps_the_last_memberships_and_is_audited(client, sso):
    sso.set_account("mia", groups=["xgen-admins"])
    sign_in(client, sso, "mia")
    client.logout()
    sso.set_account("mia")  # no groups claim at all, in the ID token or userinfo
    resp, _ = sign_in(client, sso, "mia")
    assert resp.status_code == 302
    user = User.objects.get(username="mia")
    assert (user.role, user.idp_groups) == ("admin", ["xgen-admins"])
    row = AuditEvent.objects.get(action="sso_groups_missing", target="mia")
    assert row.detail["kept_groups"] == ["xgen-admins"] and row.outcome == "failed"


def test_a_replayed_state_is_refused(client, sso):
    sso.set_account("rex", groups=[])
    resp, callback = sign_in(client, sso, "rex")
    assert resp.status_code == 302
    client.logout()
    again = client.get(local_path(callback))  # the same code and state, a second time
    assert again.status_code == 400
    assert b"state is unknown or was used already" in again.content
    assert client.get("/").status_code == 302  # not signed in
    # A state this browser never started (another browser's callback) is refused the same way.
    other = Client()
    callback2 = sso.authorize(provider_redirect(other), "rex")
    assert client.get(local_path(callback2)).status_code == 400
    assert AuditEvent.objects.filter(action="login_failed", detail__source="oidc").count() == 2


@pytest.mark.parametrize(("mode", "reason"), [("tamper", b"BadSignatureError"), ("audience", b"InvalidClaimError: invalid_claim: Invalid claim: &#x27;aud&#x27;")])
def test_an_id_token_changed_after_signing_or_for_another_audience_is_refused(client, sso, mode, reason):
    sso.set_account("eve", groups=["xgen-ops"])
    sso.next_id_token(mode=mode)
    resp, _ = sign_in(client, sso, "eve")
    assert resp.status_code == 400 and reason in resp.content, resp.content.decode()[-1500:]
    assert not User.objects.filter(username="eve").exists()
    assert client.get("/").status_code == 302
    # The provider's next, untouched token is accepted.
    resp, _ = sign_in(client, sso, "eve")
    assert resp.status_code == 302 and User.objects.get(username="eve").role == "operator"


def test_an_expired_id_token_is_refused(client, sso):
    sso.set_account("ed", groups=[])
    sso.next_id_token(mode="expired")  # signed by the provider's key, expired 5 minutes ago
    resp, _ = sign_in(client, sso, "ed")
    assert resp.status_code == 400 and b"ExpiredTokenError" in resp.content, resp.content.decode()[-1500:]
    assert not User.objects.filter(username="ed").exists()


def test_a_rotated_signing_key_is_fetched_and_accepted(client, sso):
    sso.set_account("rota", groups=["xgen-ops"])
    resp, _ = sign_in(client, sso, "rota")
    assert resp.status_code == 302  # the console holds the JWKS with key-1 now
    client.logout()
    sso.stop()
    sso.keys = [signing_key("key-2"), *sso.keys]  # the provider signs with the new key, publishes both
    sso.start()
    sso.set_account("rota", groups=["xgen-admins"])
    resp, _ = sign_in(client, sso, "rota")
    assert resp.status_code == 302, resp.content.decode()[-1500:]
    assert User.objects.get(username="rota").role == "admin"
    # A key the provider no longer publishes signs nothing the console accepts: key-1 is dropped.
    sso.stop()
    sso.keys = [signing_key("key-3")]
    sso.start()
    sso.next_id_token(mode="audience")  # re-signed with the provider's current key: still refused for aud
    client.logout()
    resp, _ = sign_in(client, sso, "rota")
    assert resp.status_code == 400


@pytest.mark.parametrize("keys", ["revoke", "keep"])
def test_a_user_the_provider_stops_accepting_loses_the_session_at_its_next_refresh(client, sso, settings, keys):
    settings.SSO_DEPROVISIONED_KEYS = keys
    sso.set_account("dana", groups=["xgen-ops"])
    sign_in(client, sso, "dana")
    user = User.objects.get(username="dana")
    from accounts.services import create_api_key

    key, _ = create_api_key(user=user, name="dana-key")
    settings.SSO_RECHECK_S = 0  # every request is a refresh
    assert client.get("/").status_code == 200  # the provider refreshes: still accepted
    sso.set_account("dana", groups=["xgen-admins"])
    assert client.get("/").status_code == 200
    user.refresh_from_db()
    assert user.role == "admin"  # the refreshed ID token's groups are synced
    sso.set_account("dana", disabled=True)
    resp = client.get("/")
    assert resp.status_code == 302 and resp["Location"] == "/accounts/login/?ended=1"
    assert client.get("/").status_code == 302
    row = AuditEvent.objects.get(action="sso_deprovision", target="dana")
    assert row.detail["reason"] == "refresh refused: invalid_grant"
    key.refresh_from_db()
    assert (key.revoked_at is not None) == (keys == "revoke")
    assert ApiKey.objects.filter(user=user, revoked_at__isnull=True).count() == (keys == "keep")
    assert "Your session ended" in client.get("/accounts/login/?ended=1").content.decode()


def test_local_sign_in_can_be_turned_off_except_for_break_glass_admins(client, sso, settings, admin, operator):
    settings.LOCAL_LOGIN = False
    settings.BREAK_GLASS_USERS = [admin.user.username]
    page = client.get("/accounts/login/").content.decode()
    assert "Break-glass sign-in" in page and "Sign in with Example IdP" in page
    resp = client.post("/accounts/login/", {"username": operator.user.username, "password": operator.password})
    assert resp.status_code == 200 and b"do not match" in resp.content
    resp = client.post("/accounts/login/", {"username": admin.user.username, "password": admin.password})
    assert resp.status_code == 302


def test_an_sso_user_has_no_password_sign_in_and_a_local_name_is_not_taken(client, sso, viewer):
    sso.set_account(viewer.user.username, groups=["xgen-admins"])  # the provider has a user of a local name
    resp, _ = sign_in(client, sso, viewer.user.username)
    assert resp.status_code == 302
    sso_user = User.objects.get(idp_source="oidc", idp_subject=viewer.user.username)
    assert sso_user.pk != viewer.user.pk and sso_user.username.startswith(viewer.user.username + "-")
    viewer.user.refresh_from_db()
    assert viewer.user.role == "viewer"  # the local account is untouched
    client.logout()
    resp = client.post("/accounts/login/", {"username": sso_user.username, "password": ""})
    assert resp.status_code == 200


def test_the_provider_down_is_a_clear_page_not_a_500(client, settings, sso):
    settings.OIDC_ISSUER = "http://127.0.0.1:9"  # nothing listens
    resp = client.get("/accounts/oidc/login/")
    assert resp.status_code == 502 and b"cannot be reached" in resp.content


def test_without_oidc_settings_the_routes_are_404(client, settings):
    settings.OIDC_ISSUER = ""
    assert client.get("/accounts/oidc/login/").status_code == 404
    assert client.get("/accounts/oidc/callback/?code=x&state=y").status_code == 404
    assert b"Sign in with" not in client.get("/accounts/login/").content


def test_the_proxy_refuses_an_sso_session_whose_check_is_overdue(client, sso):
    """The inference proxy reads sessions itself (no Django middleware): an SSO session whose last
    check with the provider is overdue past the grace is no session there, until a page checks it."""
    from accounts.credentials import SSO_PROXY_GRACE_S, _session_principal, session_cache

    sso.set_account("pia", groups=["xgen-ops"])
    sign_in(client, sso, "pia")
    key = client.session.session_key
    assert _session_principal(key).role == "operator"
    session = client.session
    session["xgen_idp"] = {**session["xgen_idp"], "checked": time.time() - 300 - SSO_PROXY_GRACE_S - 1}
    session.save()
    session_cache.clear()
    assert _session_principal(key) is None
    assert client.get("/").status_code == 200  # a page: the provider refreshes, the check is fresh again
    session_cache.clear()
    assert _session_principal(key).username == "pia"


def test_refreshes_without_the_groups_claim_keep_the_role_quietly(client, sso, settings):
    sso.set_account("quinn", groups=["xgen-ops"])
    sign_in(client, sso, "quinn")
    sso.set_account("quinn")  # the provider stops sending groups
    settings.SSO_RECHECK_S = 0
    for _ in range(3):
        assert client.get("/").status_code == 200
    assert User.objects.get(username="quinn").role == "operator"
    assert not AuditEvent.objects.filter(action="sso_groups_missing", target="quinn").exists()


def test_the_users_page_shows_where_a_user_signs_in_and_keeps_its_role_rules(client, sso, admin):
    sso.set_account("uma", groups=["xgen-ops"])
    sign_in(client, sso, "uma")
    uma = User.objects.get(username="uma")
    client.logout()
    client.force_login(admin.user)
    page = client.get("/users/").content.decode()
    assert "OpenID Connect" in page and "(groups: operator)" in page
    edit = client.get(f"/users/{uma.pk}/").content.decode()
    assert "signs in with OpenID Connect" in edit and "last known groups: xgen-ops" in edit
    # A password for an SSO user is refused; a local role below the groups' changes nothing effective,
    # one above them raises the role (and a later sync keeps it).
    resp = client.post(f"/users/{uma.pk}/", {"role": "viewer", "is_active": "on", "new_password": "a-long-pass-42"})
    assert resp.status_code == 302
    uma.refresh_from_db()
    assert not uma.has_usable_password()
    assert AuditEvent.objects.filter(action="user_change", target="uma", outcome="refused").exists()
    client.post(f"/users/{uma.pk}/", {"role": "viewer", "is_active": "on"})
    uma.refresh_from_db()
    assert (uma.local_role, uma.role) == ("viewer", "operator")
    client.post(f"/users/{uma.pk}/", {"role": "admin", "is_active": "on"})
    uma.refresh_from_db()
    assert (uma.local_role, uma.role) == ("admin", "admin")


def test_an_sso_user_never_signs_in_with_a_console_password(client, sso):
    sso.set_account("sam", groups=[])
    sign_in(client, sso, "sam")
    client.logout()
    sam = User.objects.get(username="sam")
    sam.set_password("sams-local-pass-1")  # as if set behind the console's back
    sam.save()
    resp = client.post("/accounts/login/", {"username": "sam", "password": "sams-local-pass-1"})
    assert resp.status_code == 200 and b"do not match" in resp.content


def test_groups_map_to_teams_and_a_sync_never_touches_local_memberships(client, sso, settings):
    """XGEN_SSO_GROUP_TEAMS (issue 26 #3): each sign-in adds and removes the user's IdP memberships as
    its groups say; a membership given in the console stays whatever the groups say; a sign-in
    without the groups claim keeps them all and the audit log says so."""
    from accounts.models import Team, TeamMembership
    from accounts.services import add_member, create_team

    settings.SSO_GROUP_TEAMS = '{"ml-group": ["ml", "gpu-users"], "web-group": "web", "ghost-group": "ghost"}'
    ml, gpu, web = (create_team(name=n, slug=n) for n in ("ml", "gpu-users", "web"))
    sso.set_account("theo", groups=["ml-group", "ghost-group"])
    resp, _ = sign_in(client, sso, "theo")
    assert resp.status_code == 302
    theo = User.objects.get(username="theo")

    def memberships() -> set[tuple[str, str]]:
        return set(TeamMembership.objects.filter(user=theo).values_list("team__slug", "source"))

    assert memberships() == {("ml", "idp"), ("gpu-users", "idp")}
    sync = AuditEvent.objects.filter(action="team_sync", target="theo").latest("pk")
    assert sync.detail["added"] == ["gpu-users", "ml"] and sync.detail["unknown"] == ["ghost"]
    add_member(team=web, user=theo)  # an admin puts theo in web, in the console
    add_member(team=gpu, user=theo)  # ...and makes gpu-users a local membership too
    client.logout()
    sso.set_account("theo", groups=["web-group"])  # out of ml-group; web-group now
    sign_in(client, sso, "theo")
    assert memberships() == {("web", "local"), ("gpu-users", "local")}  # ml (idp) gone, the local ones kept
    client.logout()
    sso.set_account("theo", groups=[])
    sign_in(client, sso, "theo")
    assert memberships() == {("web", "local"), ("gpu-users", "local")}
    sso.set_account("theo", groups=["ml-group"])
    client.logout()
    sign_in(client, sso, "theo")
    assert ("ml", "idp") in memberships()
    client.logout()
    sso.set_account("theo")  # no groups claim: the last known memberships stay, audited
    resp, _ = sign_in(client, sso, "theo")
    assert resp.status_code == 302
    assert memberships() == {("web", "local"), ("gpu-users", "local"), ("ml", "idp")}
    row = AuditEvent.objects.get(action="sso_groups_missing", target="theo")
    assert row.detail["kept_teams"] == ["gpu-users", "ml", "web"] and row.outcome == "failed"
    assert Team.objects.filter(slug="ghost").count() == 0  # a mapping never makes a team
