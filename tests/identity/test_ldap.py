"""LDAP sign-in (issue 26 #2, #3) against a real slapd (Debian's), started by the tests with its own
config and an LDIF of users and groups: sign-in through the login form, groups -> roles (by DN and by
name), a wrong password, a user removed from a mapped group and from the required one (the session
ends at its next check, the keys follow the setting), a local name never taken over, the directory
down (the session ends, nothing is deprovisioned)."""
from __future__ import annotations

import pytest

from accounts.models import ApiKey, AuditEvent, User
from accounts.services import create_api_key, create_user
from tests.identity.conftest import LDAP_ADMIN_DN, LDAP_ADMIN_PASSWORD, LDAP_BASE, ldif_entries, start_slapd
from tests.procs import stop_process
from xgenconsole.ldap_settings import ldap_settings

pytestmark = pytest.mark.django_db
GROUPS = f"ou=groups,{LDAP_BASE}"
USERS = {"lara": "lara-secret-1", "bob": "bob-secret-1", "carl": "carl-secret-1", "dora": "dora-secret-1"}


@pytest.fixture(scope="module")
def slapd(tmp_path_factory):
    server = start_slapd(tmp_path_factory.mktemp("slapd"), ldif_entries(USERS, {
        "xgen-users": ["lara", "bob", "carl", "dora"],  # XGEN_LDAP_REQUIRE_GROUP
        "xgen-admins": ["lara"],
        "xgen-ops": ["bob", "dora"],
        "xgen-ml": ["carl", "lara"],  # XGEN_SSO_GROUP_TEAMS, by DN (test_groups_map_to_teams...)
    }))
    yield server
    stop_process(server.proc, timeout=10)


@pytest.fixture
def ldap_on(settings, slapd, monkeypatch):
    env = {"XGEN_LDAP_URL": slapd.url, "XGEN_LDAP_USER_SEARCH_BASE": f"ou=people,{LDAP_BASE}",
           "XGEN_LDAP_GROUP_SEARCH_BASE": GROUPS, "XGEN_LDAP_REQUIRE_GROUP": f"cn=xgen-users,{GROUPS}"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name, value in ldap_settings().items():  # what settings.py does with the same environment
        setattr(settings, name, value)
    settings.AUTH_LDAP_SERVER_URI = slapd.url
    settings.AUTH_LDAP_BIND_DN = LDAP_ADMIN_DN
    settings.AUTH_LDAP_BIND_PASSWORD = LDAP_ADMIN_PASSWORD
    # A DN (JSON form) and a group name both map.
    settings.SSO_GROUP_ROLES = f'{{"cn=xgen-ops,{GROUPS}": "operator", "xgen-admins": "admin"}}'
    settings.SSO_RECHECK_S = 300
    return slapd


def sign_in(client, username: str, password: str):
    return client.post("/accounts/login/", {"username": username, "password": password})


def test_sign_in_maps_groups_to_roles(client, ldap_on):
    resp = sign_in(client, "lara", USERS["lara"])
    assert resp.status_code == 302 and resp["Location"] == "/"
    assert client.get("/").status_code == 200
    lara = User.objects.get(username="lara")
    assert (lara.idp_source, lara.idp_subject, lara.role, lara.local_role) == (
        "ldap", f"uid=lara,ou=people,{LDAP_BASE}", "admin", "")
    assert lara.email == "lara@example.test" and not lara.has_usable_password()
    assert f"cn=xgen-admins,{GROUPS}" in lara.idp_groups and "xgen-admins" in lara.idp_groups
    client.logout()
    assert sign_in(client, "bob", USERS["bob"]).status_code == 302
    assert User.objects.get(username="bob").role == "operator"
    assert AuditEvent.objects.filter(action="sso_sync", target="bob", detail__to="operator").exists()


def test_a_wrong_password_is_refused_and_audited(client, ldap_on):
    resp = sign_in(client, "bob", "not-bobs-password")
    assert resp.status_code == 200 and b"do not match" in resp.content
    assert client.get("/").status_code == 302
    assert AuditEvent.objects.filter(action="login_failed", target="bob").exists()
    assert sign_in(client, "nobody", "x-password").status_code == 200


def test_a_user_removed_from_groups_loses_the_role_then_the_session(client, ldap_on, settings):
    settings.SSO_DEPROVISIONED_KEYS = "revoke"
    assert sign_in(client, "dora", USERS["dora"]).status_code == 302
    dora = User.objects.get(username="dora")
    assert dora.role == "operator"
    key, _ = create_api_key(user=dora, name="dora-key")
    settings.SSO_RECHECK_S = 0  # every request looks dora up again
    ldap_on.modify(f"dn: cn=xgen-ops,{GROUPS}\nchangetype: modify\ndelete: member\n"
                   f"member: uid=dora,ou=people,{LDAP_BASE}\n")
    assert client.get("/").status_code == 200
    dora.refresh_from_db()
    assert (dora.role, dora.idp_role) == ("viewer", "")  # out of the mapped group: its role is gone
    ldap_on.modify(f"dn: cn=xgen-users,{GROUPS}\nchangetype: modify\ndelete: member\n"
                   f"member: uid=dora,ou=people,{LDAP_BASE}\n")
    resp = client.get("/")
    assert resp.status_code == 302 and resp["Location"] == "/accounts/login/?ended=1"
    row = AuditEvent.objects.get(action="sso_deprovision", target="dora")
    assert "AUTH_LDAP_REQUIRE_GROUP" in row.detail["reason"] and row.detail["revoked_keys"] == [key.prefix]
    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None
    # And the next sign-in is refused.
    assert sign_in(client, "dora", USERS["dora"]).status_code == 200


def test_groups_map_to_teams_and_leaving_the_group_leaves_the_team(client, ldap_on, settings):
    """XGEN_SSO_GROUP_TEAMS through LDAP (issue 26 #3): the directory's group (by DN, and by name)
    puts the user in the team at sign-in; out of the group, the session's next check takes the
    directory's membership away and leaves the one an admin gave in the console."""
    from accounts.models import TeamMembership
    from accounts.services import add_member, create_team

    settings.SSO_GROUP_TEAMS = f'{{"cn=xgen-ml,{GROUPS}": "ml", "xgen-users": "everyone"}}'
    ml, everyone, web = (create_team(name=n, slug=n) for n in ("ml", "everyone", "web"))
    assert sign_in(client, "carl", USERS["carl"]).status_code == 302
    carl = User.objects.get(username="carl")

    def memberships() -> set[tuple[str, str]]:
        return set(TeamMembership.objects.filter(user=carl).values_list("team__slug", "source"))

    assert memberships() == {("ml", "idp"), ("everyone", "idp")}
    assert AuditEvent.objects.get(action="team_sync", target="carl").detail["added"] == ["everyone", "ml"]
    add_member(team=web, user=carl)  # given in the console
    settings.SSO_RECHECK_S = 0  # every request looks carl up again
    ldap_on.modify(f"dn: cn=xgen-ml,{GROUPS}\nchangetype: modify\ndelete: member\n"
                   f"member: uid=carl,ou=people,{LDAP_BASE}\n")
    try:
        assert client.get("/").status_code == 200  # still in xgen-users: still signed in
        assert memberships() == {("everyone", "idp"), ("web", "local")}
        assert AuditEvent.objects.filter(action="team_sync", target="carl").latest("pk").detail["removed"] == ["ml"]
    finally:
        ldap_on.modify(f"dn: cn=xgen-ml,{GROUPS}\nchangetype: modify\nadd: member\n"
                       f"member: uid=carl,ou=people,{LDAP_BASE}\n")


def test_a_local_name_is_not_taken_over_by_the_directory(client, ldap_on):
    create_user(username="carl", role="viewer", password="carl-local-pass-9")
    assert sign_in(client, "carl", USERS["carl"]).status_code == 200  # the directory's carl is not this one
    assert User.objects.get(username="carl").idp_source == ""
    assert sign_in(client, "carl", "carl-local-pass-9").status_code == 302  # the local password still works


def test_the_directory_down_ends_the_session_without_deprovisioning(client, ldap_on, settings):
    assert sign_in(client, "bob", USERS["bob"]).status_code == 302
    bob = User.objects.get(username="bob")
    key, _ = create_api_key(user=bob, name="bob-key")
    settings.SSO_RECHECK_S = 0
    settings.SSO_DEPROVISIONED_KEYS = "revoke"
    settings.AUTH_LDAP_SERVER_URI = "ldap://127.0.0.1:9"  # nothing listens
    resp = client.get("/")
    assert resp.status_code == 302 and resp["Location"] == "/accounts/login/?ended=1"
    assert not AuditEvent.objects.filter(action="sso_deprovision").exists()
    assert ApiKey.objects.get(pk=key.pk).revoked_at is None


def test_start_tls_against_a_directory_without_tls_refuses_cleanly(client, ldap_on, settings):
    settings.AUTH_LDAP_START_TLS = True  # this slapd has no certificate: the StartTLS request fails
    resp = sign_in(client, "bob", USERS["bob"])
    assert resp.status_code == 200 and b"do not match" in resp.content
    assert not User.objects.filter(username="bob").exists()


@pytest.fixture(scope="module")
def slapd_tls(tmp_path_factory):
    server = start_slapd(tmp_path_factory.mktemp("slapd-tls"), ldif_entries(USERS, {"xgen-ops": ["bob"]}), tls=True)
    yield server
    stop_process(server.proc, timeout=10)


@pytest.mark.parametrize("how", ["starttls", "ldaps"])
def test_tls_with_the_directorys_ca_binds_as_the_user(client, settings, slapd_tls, monkeypatch, how):
    """StartTLS on ldap:// and ldaps://, the CA from XGEN_LDAP_CA_FILE, and the bind-as-the-user mode
    (XGEN_LDAP_USER_DN_TEMPLATE: no search, no service account; the groups are read as the user)."""
    url = slapd_tls.url if how == "starttls" else f"ldaps://127.0.0.1:{slapd_tls.tls_port}"
    env = {"XGEN_LDAP_URL": url, "XGEN_LDAP_USER_DN_TEMPLATE": f"uid=%(user)s,ou=people,{LDAP_BASE}",
           "XGEN_LDAP_GROUP_SEARCH_BASE": GROUPS, "XGEN_LDAP_CA_FILE": str(slapd_tls.workdir / "cert.pem")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name, value in ldap_settings().items():
        setattr(settings, name, value)
    settings.AUTH_LDAP_SERVER_URI = url
    settings.AUTH_LDAP_START_TLS = how == "starttls"
    settings.AUTH_LDAP_BIND_DN, settings.AUTH_LDAP_BIND_PASSWORD = "", ""
    settings.SSO_GROUP_ROLES = "xgen-ops=operator"
    assert sign_in(client, "bob", "wrong-password").status_code == 200
    assert sign_in(client, "bob", USERS["bob"]).status_code == 302
    assert User.objects.get(username="bob").role == "operator"
    # Without the CA the server's certificate is not trusted: refused, not a 500.
    client.logout()
    monkeypatch.delenv("XGEN_LDAP_CA_FILE")
    settings.AUTH_LDAP_CONNECTION_OPTIONS = ldap_settings()["AUTH_LDAP_CONNECTION_OPTIONS"]
    assert sign_in(client, "bob", USERS["bob"]).status_code == 200
