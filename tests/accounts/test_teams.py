"""Teams (issue 26 #4, #5): the /api/teams CRUD (admin), keys owned by a team, each change audited,
and a team lead that sees and manages its own team's keys and usage and nothing of other teams
(enforced by the server: another team answers 404, as one that does not exist)."""
from __future__ import annotations

import re

import pytest
from django.test import Client
from django.utils import timezone

from accounts.models import ApiKey, AuditEvent, Team, TeamMembership
from accounts.services import add_member, create_api_key, create_team, create_user
from serving.models import RequestLog, UsageBucket
from tests.conftest import bearer

pytestmark = pytest.mark.django_db


def j(client: Client, method: str, path: str, key: str, body: dict | None = None):
    kwargs = {"content_type": "application/json", **bearer(key)}
    if body is not None:
        kwargs["data"] = body
    return getattr(client, method)(path, **kwargs)


@pytest.fixture
def two_teams(admin):
    """Teams ml and web, each with a lead (a viewer) and a key that used 100 tokens this hour."""
    out = {}
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    for slug in ("ml", "web"):
        team = create_team(name=slug.upper(), slug=slug)
        lead = create_user(username=f"{slug}-lead", role="viewer", password=f"{slug}-lead-pass-1")
        add_member(team=team, user=lead, is_lead=True)
        _, lead_key = create_api_key(user=lead, name=f"{slug}-lead-key")
        key, _ = create_api_key(user=lead, name=f"{slug}-app", team=team)
        UsageBucket.objects.create(bucket_start=hour, key_id=key.pk, key_name=key.name, username=lead.username,
                                   model=f"{slug}-model", requests=2, prompt_tokens=60, completion_tokens=40,
                                   team_id=team.pk, team_slug=slug)
        RequestLog.objects.create(at=timezone.now(), request_id=f"req-{slug}", key_id=key.pk, key_name=key.name,
                                  username=lead.username, model=f"{slug}-model", status=200,
                                  team_id=team.pk, team_slug=slug)
        out[slug] = {"team": team, "lead": lead, "lead_key": lead_key, "key": key}
    return out


def test_admin_creates_changes_and_deletes_a_team_each_audited(client, admin):
    r = j(client, "post", "/api/teams", admin.key, {"name": "Research", "daily_tokens": 1000,
                                                    "allowed_models": ["m1"], "gpu_seconds_month": 3600})
    assert r.status_code == 201, r.content
    team = r.json()
    assert (team["slug"], team["daily_tokens"], team["allowed_models"], team["members"]) == ("research", 1000, ["m1"], [])
    assert j(client, "post", "/api/teams", admin.key, {"name": "Research"}).status_code == 400
    r = j(client, "patch", f"/api/teams/{team['id']}", admin.key, {"rpm": 5, "daily_tokens": None})
    assert r.status_code == 200 and (r.json()["rpm"], r.json()["daily_tokens"]) == (5, None)
    r = j(client, "post", f"/api/teams/{team['id']}/members", admin.key, {"username": admin.user.username,
                                                                          "is_lead": True})
    assert r.json()["members"] == [{"username": admin.user.username, "source": "local", "is_lead": True}]
    r = j(client, "post", "/api/keys", admin.key, {"name": "svc", "username": admin.user.username, "team": "research"})
    assert r.status_code == 201 and (r.json()["team"], r.json()["team_id"]) == ("research", team["id"])
    key_id = r.json()["id"]
    assert j(client, "post", "/api/keys", admin.key, {"name": "x", "username": admin.user.username,
                                                      "team": "nope"}).status_code == 404
    r = j(client, "patch", f"/api/keys/{key_id}", admin.key, {"team": None})
    assert r.status_code == 200 and r.json()["team"] is None
    assert j(client, "patch", f"/api/keys/{key_id}", admin.key, {"team": "research"}).json()["team"] == "research"
    r = j(client, "delete", f"/api/teams/{team['id']}/members/{admin.user.username}", admin.key)
    assert r.status_code == 200 and r.json()["members"] == []
    assert j(client, "delete", f"/api/teams/{team['id']}", admin.key).status_code == 200
    assert ApiKey.objects.get(pk=key_id).team_id is None  # the key stays, without a team
    actions = set(AuditEvent.objects.values_list("action", flat=True))
    assert {"team_create", "team_change", "team_member_add", "team_member_remove", "team_delete"} <= actions
    assert any("team" in e.detail["changed"] for e in AuditEvent.objects.filter(action="key_change"))


def test_a_team_lead_sees_and_manages_only_its_own_team(client, two_teams):
    ml, web = two_teams["ml"], two_teams["web"]
    key = ml["lead_key"]
    listed = j(client, "get", "/api/teams", key).json()
    assert [t["slug"] for t in listed] == ["ml"]
    assert j(client, "get", f"/api/teams/{ml['team'].pk}", key).status_code == 200
    # Another team: 404 as for none at all, on every route.
    other = web["team"].pk
    for method, path in (("get", f"/api/teams/{other}"), ("get", f"/api/teams/{other}/keys"),
                         ("post", f"/api/teams/{other}/keys"), ("delete", f"/api/teams/{other}/keys/{web['key'].pk}")):
        r = j(client, method, path, key, {"name": "sneak"} if method == "post" else None)
        assert r.status_code == 404 and r.json()["error"]["code"] == "team_not_found", (method, path, r.content)
    # Admin-only changes stay admin-only.
    assert j(client, "patch", f"/api/teams/{ml['team'].pk}", key, {"rpm": 1}).status_code == 403
    assert j(client, "post", "/api/teams", key, {"name": "mine"}).status_code == 403
    # Its own team's keys: list, create (inference only by default), revoke.
    keys = j(client, "get", f"/api/teams/{ml['team'].pk}/keys", key).json()
    assert [k["name"] for k in keys] == ["ml-app"]
    r = j(client, "post", f"/api/teams/{ml['team'].pk}/keys", key, {"name": "ml-batch"})
    assert r.status_code == 201 and r.json()["team"] == "ml" and r.json()["scopes"] == ["inference"], r.content
    assert j(client, "post", f"/api/teams/{ml['team'].pk}/keys", key,
             {"name": "for-outsider", "username": web["lead"].username}).status_code == 404  # not a member
    r = j(client, "delete", f"/api/teams/{ml['team'].pk}/keys/{r.json()['id']}", key)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    # Usage, chargeback and the request log: its team's keys only, whatever it asks.
    usage = j(client, "get", "/api/usage?group_by=team", key).json()["items"]
    assert {(i["team"], i["prompt_tokens"] + i["completion_tokens"]) for i in usage} == {("ml", 100)}
    assert j(client, "get", "/api/usage?team=web", key).status_code == 404
    by_key = j(client, "get", "/api/usage?group_by=key", key).json()["items"]
    assert {i["key_name"] for i in by_key} == {"ml-app"}
    rows = j(client, "get", "/api/requests", key).json()["items"]
    assert [(r["request_id"], r["team"]) for r in rows] == [("req-ml", "ml")]
    assert j(client, "get", "/api/requests?team=web", key).status_code == 404
    charge = j(client, "get", "/api/usage/chargeback?group_by=team", key).json()
    assert charge["idle"] == [] and all(i["team"] == "ml" for i in charge["items"])
    # Pages: its team's page, not the other's; the Teams list shows its own only.
    browser = Client()
    browser.force_login(ml["lead"])
    assert browser.get(f"/teams/{ml['team'].pk}/").status_code == 200
    assert browser.get(f"/teams/{other}/").status_code == 404
    page = browser.get("/teams/").content.decode()
    assert "ML" in page and "WEB" not in page
    assert browser.get("/usage/?team=web").status_code == 404
    usage_page = browser.get("/usage/?group=team").content.decode()
    assert ">ml<" in usage_page and ">web<" not in usage_page and "ml-model" in usage_page
    assert "web-model" not in usage_page
    requests_page = browser.get("/requests/").content.decode()
    assert "req-ml" in requests_page and "req-web" not in requests_page
    assert browser.post(f"/teams/{other}/", {"action": "key_create", "name": "x"}).status_code == 404


def test_an_admin_reads_every_team_and_filters_by_one(client, admin, two_teams):
    usage = j(client, "get", "/api/usage?group_by=team", admin.key).json()["items"]
    assert {i["team"] for i in usage} == {"ml", "web"}
    only = j(client, "get", "/api/usage?team=web&group_by=model", admin.key).json()["items"]
    assert [i["model"] for i in only] == ["web-model"]
    rows = j(client, "get", "/api/requests?team=ml", admin.key).json()["items"]
    assert [r["request_id"] for r in rows] == ["req-ml"]
    assert [t["slug"] for t in j(client, "get", "/api/teams", admin.key).json()] == ["ml", "web"]
    browser = Client()
    browser.force_login(admin.user)
    assert browser.get(f"/teams/{two_teams['web']['team'].pk}/").status_code == 200
    r = browser.post("/teams/", {"name": "Ops", "rpm": "10"})
    assert r.status_code == 302 and Team.objects.get(slug="ops").rpm == 10


def test_a_viewer_that_leads_no_team_sees_no_team(client, viewer, two_teams):
    assert j(client, "get", "/api/teams", viewer.key).json() == []
    assert j(client, "get", f"/api/teams/{two_teams['ml']['team'].pk}", viewer.key).status_code == 404
    assert TeamMembership.objects.filter(user=viewer.user).count() == 0


def test_the_group_to_team_mapping_reads_both_forms_and_refuses_a_wrong_entry():
    from accounts.sso import MappingError, parse_group_teams

    assert parse_group_teams("") == {}
    assert parse_group_teams("ML-Group=ml, ml-group=gpu-users,web=web") == {"ml-group": ["ml", "gpu-users"],
                                                                          "web": ["web"]}
    assert parse_group_teams('{"cn=ml,ou=groups,dc=x": ["ml", "ML"], "Ops": "ops_team"}') == {
        "cn=ml,ou=groups,dc=x": ["ml"], "ops": ["ops_team"]}
    for wrong in ("no-equals", '{"g": "not a slug!"}', "[1]", "{bad json", "g="):
        with pytest.raises(MappingError):
            parse_group_teams(wrong)


def test_the_keys_page_and_createapikey_give_a_key_to_a_team(admin):
    from django.core.management import call_command

    team = create_team(name="Research", slug="research")
    browser = Client()
    browser.force_login(admin.user)
    r = browser.post("/keys/", {"name": "paged", "user": admin.user.pk, "team": team.pk})
    assert r.status_code == 302
    key = ApiKey.objects.get(name="paged")
    assert key.team_id == team.pk and "research" in browser.get("/keys/").content.decode()
    r = browser.post(f"/keys/{key.pk}/", {"name": "paged", "team": "", "priority": 4})
    assert r.status_code == 302 and ApiKey.objects.get(pk=key.pk).team_id is None
    assert any("team" in e.detail["changed"] for e in AuditEvent.objects.filter(action="key_change"))
    call_command("createapikey", "--username", admin.user.username, "--name", "cli-key", "--team", "research")
    assert ApiKey.objects.get(name="cli-key").team_id == team.pk


def test_the_team_page_shows_gpu_seconds_used_against_the_budget(two_teams):
    """The figure is chargeback's (the one the proxy refuses on): 60 busy seconds on a 2-GPU
    instance without READY history are 120 GPU-seconds."""
    from hardware.models import Node
    from serving.models import ModelInstance

    ml, web = two_teams["ml"], two_teams["web"]
    node = Node.objects.create(name="n-budget", address="127.0.0.1", last_heartbeat=timezone.now())
    inst = ModelInstance.objects.create(model_name="ml-model", model_path="/m", backend="b", node=node, gpus=[0, 1],
                                        state="STOPPED")
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    for t, busy in ((ml, 60), (web, 10)):
        UsageBucket.objects.create(bucket_start=hour, key_id=t["key"].pk, key_name=t["key"].name, username="u",
                                   model="gpu", instance_id=inst.pk, node="n-budget", busy_seconds=busy,
                                   team_id=t["team"].pk, team_slug=t["team"].slug)
    Team.objects.filter(pk__in=[ml["team"].pk, web["team"].pk]).update(gpu_seconds_month=100)
    browser = Client()
    browser.force_login(ml["lead"])  # a lead sees its team's
    page = browser.get(f"/teams/{ml['team'].pk}/").content.decode()
    assert "GPU-seconds budget: <strong>120.0</strong> used of <strong>100</strong> (100%): used up." in page
    assert "team_gpu_budget_exhausted" in page
    browser.force_login(web["lead"])
    page = browser.get(f"/teams/{web['team'].pk}/").content.decode()
    assert "GPU-seconds budget: <strong>20.0</strong> used of <strong>100</strong> (20%), 80.0 left" in page
    Team.objects.filter(pk=web["team"].pk).update(gpu_seconds_month=None)
    assert "team-gpu-budget" not in browser.get(f"/teams/{web['team'].pk}/").content.decode()


@pytest.fixture
def held_gpus(two_teams):
    """gpu-a: GPUs 0-1 held by ml-model, 2 by web-model, 3 free; gpu-b: GPU 0 held by other-model."""
    from hardware.models import Node
    from hardware.services import save_inventory
    from serving.models import InstanceState, ModelInstance
    from tests.hardware.conftest import gpu_inventory

    out = {}
    for name, count in (("gpu-a", 4), ("gpu-b", 1)):
        Node.objects.create(name=name, address="10.0.0.5", last_heartbeat=timezone.now())
        out[name] = save_inventory(node_name=name, result=gpu_inventory(*range(count)))
    for model, node, gpus in (("ml-model", "gpu-a", [0, 1]), ("web-model", "gpu-a", [2]), ("other-model", "gpu-b", [0])):
        out[model] = ModelInstance.objects.create(model_name=model, model_path="/m", backend="vllm", node=out[node],
                                                  gpus=gpus, state=InstanceState.READY)
    return out


def test_a_team_lead_sees_only_the_gpus_its_teams_models_hold(client, two_teams, held_gpus, viewer, operator):
    ml = two_teams["ml"]
    browser = Client()
    browser.force_login(ml["lead"])
    page = browser.get("/gpus/").content.decode()
    assert f'href="/instances/{held_gpus["ml-model"].pk}/">ml-model</a>' in page
    assert "web-model" not in page and "other-model" not in page and "gpu-b" not in page
    assert '<strong id="count-gpus">2</strong>' in page and '<strong id="count-instances">1</strong>' in page
    assert 'ws-connect' not in page  # the live cards are every node's: its page polls
    assert "web-model" not in browser.get("/gpus/", HTTP_HX_REQUEST="true").content.decode()
    node_page = browser.get("/nodes/gpu-a/").content.decode()
    assert "ml-model" in node_page and "web-model" not in node_page
    assert "gpu1 used" in node_page and "gpu2 used" not in node_page  # its GPUs' history only
    assert browser.get("/nodes/gpu-b/").status_code == 404  # as a node that does not exist
    nodes = j(client, "get", "/api/hardware/nodes", ml["lead_key"]).json()
    assert [(n["name"], [g["index"] for g in n["gpus"]]) for n in nodes] == [("gpu-a", [0, 1])]
    # A team with allowed models sees the GPUs those hold, whatever its keys used.
    Team.objects.filter(pk=ml["team"].pk).update(allowed_models=["other-model"])
    nodes = j(client, "get", "/api/hardware/nodes", ml["lead_key"]).json()
    assert [(n["name"], [g["instance_id"] for g in n["gpus"]]) for n in nodes] == [("gpu-b", [held_gpus["other-model"].pk])]
    # A viewer that leads no team, and an operator (a lead or not), see every GPU.
    add_member(team=ml["team"], user=operator.user, is_lead=True)
    for key in (viewer.key, operator.key):
        nodes = j(client, "get", "/api/hardware/nodes", key).json()
        assert {n["name"]: len(n["gpus"]) for n in nodes} == {"gpu-a": 4, "gpu-b": 1}
    browser.force_login(viewer.user)
    assert "web-model" in browser.get("/gpus/").content.decode()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("routing,path", [("hardware.routing", "/ws/gpus/"), ("serving.routing", "/ws/dashboard/1h/")])
async def test_a_team_lead_gets_no_live_fleet_page(two_teams, viewer, routing, path):
    """The live GPU cards and the dashboard are every node's and every team's: a lead is refused."""
    from importlib import import_module

    from channels.routing import URLRouter
    from channels.testing import WebsocketCommunicator

    app = URLRouter(import_module(routing).websocket_urlpatterns)
    for user, allowed in ((two_teams["ml"]["lead"], False), (viewer.user, True)):
        comm = WebsocketCommunicator(app, path)
        comm.scope["user"] = user
        connected, code = await comm.connect()
        assert connected is allowed and (allowed or code == 4403)
        if connected:
            await comm.disconnect()


def test_admins_see_the_group_mapping_on_the_teams_page_and_leads_do_not(client, admin, two_teams, settings):
    """The mapping (issue 26 #3, #5), as the settings give it: each group's role and teams, a team
    that does not exist flagged, and a mapping the settings cannot read shown as its error."""
    settings.SSO_GROUP_ROLES = '{"cn=ops,ou=groups,dc=x": "operator", "ml-group": "viewer"}'
    settings.SSO_GROUP_TEAMS = '{"ml-group": ["ml", "ghost"], "web-group": "web"}'
    browser = Client()
    browser.force_login(admin.user)
    page = browser.get("/teams/").content.decode()
    rows = re.findall(r"<tr><td><code>([^<]+)</code></td><td>([^<]*)</td>\s*<td>(.*?)</td></tr>", page, re.S)
    assert [(g, role, re.sub(r"<[^>]+>", "", teams)) for g, role, teams in rows] == [
        ("cn=ops,ou=groups,dc=x", "operator", "—"), ("ml-group", "viewer", "ml, ghost no such team"),
        ("web-group", "—", "web")]
    settings.SSO_GROUP_TEAMS = "cn=a,dc=b=ml"
    page = browser.get("/teams/").content.decode()
    assert 'role="alert">XGEN_SSO_GROUP_TEAMS entry' in page
    browser.force_login(two_teams["ml"]["lead"])  # a lead: its teams, not the mapping
    page = browser.get("/teams/").content.decode()
    assert "sso-mapping" not in page and "ML" in page


def test_a_team_leads_home_page_is_its_team_and_the_fleet_dashboard_is_not_theirs(two_teams, viewer, operator):
    """The dashboard charts every node's GPUs and every team's traffic: a lead held to its teams is
    sent to its team's page (one team) or its teams (several); a viewer that leads no team and an
    operator who leads one keep the dashboard."""
    ml, web = two_teams["ml"], two_teams["web"]
    browser = Client()
    browser.force_login(ml["lead"])
    response = browser.get("/")
    assert (response.status_code, response["Location"]) == (302, f"/teams/{ml['team'].pk}/")
    assert browser.get("/?range=7d", HTTP_HX_REQUEST="true")["Location"] == f"/teams/{ml['team'].pk}/"
    add_member(team=web["team"], user=ml["lead"], is_lead=True)
    assert browser.get("/")["Location"] == "/teams/"
    add_member(team=ml["team"], user=operator.user, is_lead=True)
    for user in (viewer.user, operator.user):
        browser.force_login(user)
        response = browser.get("/")
        assert response.status_code == 200 and 'ws-connect="/ws/dashboard/' in response.content.decode(), user

