"""Team limits through a real console (issue 26 #4): a team's token quota, rpm and allowed models
count every key the team owns together, on top of each key's own; the refusal names the team. The
keys carry no limits of their own: only the team's refuse them. Usage and the request log by team.
A team's GPU-seconds budget refuses its keys once chargeback's figure for the team reaches it."""
from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest

from tests.procs import stop_process
from tests.proxy.conftest import ProxyConsole
from tests.proxy.test_limits_and_usage import UsageBackend, _console, chat, error_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def usage_backend() -> Iterator[UsageBackend]:
    backend = UsageBackend()
    yield backend
    backend.stop()


@pytest.fixture(scope="module")
def teams_console(tmp_path_factory, usage_backend) -> Iterator[ProxyConsole]:
    console = _console(tmp_path_factory, "teams-console")
    try:
        console.manage("createuser", "--username", "tess", "--role", "viewer", "--password", "tess-pass-123")
        console.manage("createuser", "--username", "uma", "--role", "viewer", "--password", "uma-pass-1234")
        admin_key = console.manage("createapikey", "--username", "admin").stdout.split()[-1]
        pc = ProxyConsole(console=console, key=admin_key)
        pc.ids = pc.set_instances([{"name": "usage-echo", "port": usage_backend.port},
                                   {"name": "other-echo", "port": usage_backend.port}])
        pc.wait_models({"usage-echo", "other-echo"})
        yield pc
    finally:
        code = stop_process(console.proc, timeout=30)
    assert code == 0, console.log[-3000:]
    assert "proxy failed" not in console.log and "Traceback" not in console.log, console.log[-5000:]


def new_team(pc: ProxyConsole, **limits) -> dict:
    r = httpx.post(f"{pc.url}/api/teams", json={"name": f"t-{time.monotonic_ns()}", **limits}, headers=pc.auth)
    assert r.status_code == 201, r.text
    for user in ("tess", "uma"):
        assert httpx.post(f"{pc.url}/api/teams/{r.json()['id']}/members", json={"username": user},
                          headers=pc.auth).status_code == 200
    return r.json()


def team_key(pc: ProxyConsole, team: dict | None, user: str) -> str:
    body = {"name": f"k-{time.monotonic_ns()}", "username": user, **({"team": team["slug"]} if team else {})}
    r = httpx.post(f"{pc.url}/api/keys", json=body, headers=pc.auth)
    assert r.status_code == 201, r.text
    return r.json()["key"]


def test_a_team_quota_reached_by_two_keys_together_refuses_both(teams_console):
    pc = teams_console
    team = new_team(pc, daily_tokens=25)
    a, b = team_key(pc, team, "tess"), team_key(pc, team, "uma")
    outsider = team_key(pc, None, "tess")
    assert chat(pc, a).status_code == 200  # 10 tokens (each answer is 10)
    assert chat(pc, b).status_code == 200  # 20
    assert chat(pc, a).status_code == 200  # 20 < 25 when it came in: 30 now
    for key in (a, b):
        refused = chat(pc, key)
        assert refused.status_code == 429, refused.text
        err = error_of(refused)
        assert err["code"] == "insufficient_quota" and err["type"] == "rate_limit_error"
        assert f"team '{team['name']}'" in err["message"] and "all its keys together" in err["message"]
        assert int(refused.headers["retry-after"]) >= 1
    assert chat(pc, outsider).status_code == 200  # the same user's key outside the team is not limited
    # A new key of the team is refused too: the quota is the team's.
    assert chat(pc, team_key(pc, team, "tess")).status_code == 429
    # Raising the team's quota takes effect at once.
    assert httpx.patch(f"{pc.url}/api/teams/{team['id']}", json={"daily_tokens": 1000},
                       headers=pc.auth).status_code == 200
    assert chat(pc, b).status_code == 200
    # Usage by team (written within XGEN_USAGE_FLUSH=1 s): 40 tokens, 4 answered + 3 refused requests.
    deadline = time.monotonic() + 15
    while True:
        items = httpx.get(f"{pc.url}/api/usage?group_by=team&team={team['slug']}", headers=pc.auth).json()["items"]
        tokens = sum(i["prompt_tokens"] + i["completion_tokens"] for i in items)
        if tokens >= 40 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert tokens == 40 and {i["team"] for i in items} == {team["slug"]}, items
    assert sum(i["requests"] for i in items) == 7
    rows = httpx.get(f"{pc.url}/api/requests?team={team['slug']}", headers=pc.auth).json()["items"]
    assert len(rows) == 7 and {r["team"] for r in rows} == {team["slug"]}
    assert sorted(r["status"] for r in rows) == [200] * 4 + [429] * 3


def test_a_team_rpm_counts_every_key_of_the_team(teams_console):
    pc = teams_console
    team = new_team(pc, rpm=2)
    a, b = team_key(pc, team, "tess"), team_key(pc, team, "uma")
    assert chat(pc, a).status_code == 200
    second = chat(pc, b)
    assert second.status_code == 200 and second.headers["x-ratelimit-limit-requests"] == "2"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    third = chat(pc, a)
    assert third.status_code == 429 and error_of(third)["code"] == "rate_limit_exceeded"
    assert "team" in error_of(third)["message"] and "2 requests per minute" in error_of(third)["message"]


def test_a_team_allowed_models_refuse_others_for_every_key(teams_console):
    pc = teams_console
    team = new_team(pc, allowed_models=["usage-echo"])
    key = team_key(pc, team, "uma")
    assert chat(pc, key).status_code == 200
    refused = chat(pc, key, model="other-echo")
    assert refused.status_code == 403 and error_of(refused)["code"] == "model_not_allowed"
    assert f"team '{team['name']}'" in error_of(refused)["message"]
    listing = httpx.get(f"{pc.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
    assert [m["id"] for m in listing["data"]] == ["usage-echo"]


def _busy_seconds(pc: ProxyConsole, key: str, seconds: float) -> None:
    """`seconds` of busy time of `key` this hour on a stopped 2-GPU instance without READY history,
    written as the usage recorder writes it: chargeback counts 2 x `seconds` GPU-seconds for it."""
    code = f"""
import uuid
from django.utils import timezone
from accounts.models import ApiKey, hash_key
from hardware.models import Node
from serving.models import ModelInstance, UsageBucket
key = ApiKey.objects.get(key_hash=hash_key({key!r}))
node = Node.objects.first()
inst = ModelInstance.objects.create(model_name="gone-" + uuid.uuid4().hex[:6], model_path="/m", backend="b",
                                    node=node, gpus=[0, 1], state="STOPPED")
UsageBucket.objects.create(bucket_start=timezone.now().replace(minute=0, second=0, microsecond=0), key_id=key.pk,
                           key_name=key.name, username=key.user.username, model=inst.model_name,
                           instance_id=inst.pk, node=node.name, requests=1, busy_seconds={seconds},
                           team_id=key.team_id or 0, team_slug=key.team.slug if key.team else "")
"""
    pc.console.manage("shell", "-c", code)


def test_a_team_gpu_budget_refuses_its_keys_once_chargeback_reaches_it(teams_console):
    pc = teams_console
    team = new_team(pc, gpu_seconds_month=100)
    unbudgeted = new_team(pc)
    a, b = team_key(pc, team, "tess"), team_key(pc, team, "uma")
    free = team_key(pc, unbudgeted, "tess")
    assert chat(pc, a).status_code == 200  # nothing used yet
    _busy_seconds(pc, b, 60)  # 120 GPU-seconds of a 100 budget
    _busy_seconds(pc, free, 500)  # 1,000 GPU-seconds, no budget
    deadline = time.monotonic() + 30  # the web process re-reads the figures every XGEN_TEAM_GPU_BUDGET_REFRESH_S (5)
    while (r := chat(pc, a)).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.3)
    charged = httpx.get(f"{pc.url}/api/usage/chargeback", headers=pc.auth,
                        params={"group_by": "team", "team": team["slug"]}).json()["items"]
    # 120 GPU-seconds, and the few ms of GPU time of key a's answered requests on usage-echo.
    assert [i["team"] for i in charged] == [team["slug"]] and charged[0]["gpu_seconds"] == pytest.approx(120, abs=1)
    for key in (a, b):
        refused = r if key == a else chat(pc, key)
        assert refused.status_code == 429, refused.text
        err = error_of(refused)
        assert err["code"] == "team_gpu_budget_exhausted" and err["type"] == "rate_limit_error"
        said = re.fullmatch(rf"The team '{team['name']}' has used its GPU-seconds budget for this month: "
                            r"([0-9.]+) of 100 GPU-seconds \(all its keys together\); it renews in \w+\.", err["message"])
        assert said and float(said[1]) == pytest.approx(charged[0]["gpu_seconds"], abs=0.1), err  # the page's figure
        now = datetime.now(tz=UTC)
        month_end = (now.replace(year=now.year + 1, month=1) if now.month == 12 else now.replace(month=now.month + 1)
                     ).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        assert abs(int(refused.headers["retry-after"]) - (month_end - now).total_seconds()) < 60
    # Every inference path goes through the one admission.
    auth = {"Authorization": f"Bearer {a}"}
    for path, body in (("/v1/embeddings", {"model": "usage-echo", "input": "x"}),
                       ("/api/inference/v1/chat/completions", {"model": "usage-echo", "messages": []}),
                       ("/v1/messages", {"model": "usage-echo", "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "x"}]})):
        assert httpx.post(f"{pc.url}{path}", json=body, headers=auth, timeout=30).status_code == 429, path
    assert chat(pc, free).status_code == 200  # a team without a budget is not limited by its GPU-seconds
    # A larger budget takes effect at once (the team's keys' cached entries are dropped everywhere).
    assert httpx.patch(f"{pc.url}/api/teams/{team['id']}", json={"gpu_seconds_month": 1000},
                       headers=pc.auth).status_code == 200
    assert chat(pc, b).status_code == 200


def test_a_key_moved_to_another_team_leaves_its_usage_with_the_first(teams_console):
    """Usage, the request log, chargeback and team quotas name the team that owned the key when it
    was used: a key moved from one team to another takes none of its past usage along (before, all
    of it followed the key to its new team, and out of the old team's quota)."""
    pc = teams_console
    first, second = new_team(pc, daily_tokens=25), new_team(pc, daily_tokens=1000)
    r = httpx.post(f"{pc.url}/api/keys", json={"name": f"k-{time.monotonic_ns()}", "username": "tess",
                                               "team": first["slug"]}, headers=pc.auth)
    assert r.status_code == 201, r.text
    key_id, key = r.json()["id"], r.json()["key"]
    assert chat(pc, key).status_code == 200 and chat(pc, key).status_code == 200  # 20 tokens, the first team's
    r = httpx.patch(f"{pc.url}/api/keys/{key_id}", json={"team": second["slug"]}, headers=pc.auth)
    assert r.status_code == 200 and r.json()["team"] == second["slug"], r.text
    assert chat(pc, key).status_code == 200  # 10 tokens, the second team's

    def by_team() -> dict[str, tuple[int, int]]:
        items = httpx.get(f"{pc.url}/api/usage?group_by=team&key={key_id}", headers=pc.auth).json()["items"]
        out: dict[str, tuple[int, int]] = {}
        for i in items:
            requests, tokens = out.get(i["team"], (0, 0))
            out[i["team"]] = (requests + i["requests"], tokens + i["prompt_tokens"] + i["completion_tokens"])
        return out

    deadline = time.monotonic() + 15  # written within XGEN_USAGE_FLUSH=1 s
    while (seen := by_team()) != {first["slug"]: (2, 20), second["slug"]: (1, 10)} and time.monotonic() < deadline:
        time.sleep(0.3)
    assert seen == {first["slug"]: (2, 20), second["slug"]: (1, 10)}
    for team, statuses in ((first, [200, 200]), (second, [200])):
        rows = httpx.get(f"{pc.url}/api/requests?team={team['slug']}", headers=pc.auth).json()["items"]
        assert [r["status"] for r in rows] == statuses and {r["team"] for r in rows} == {team["slug"]}, rows
    # The first team's quota still counts what the key used while it was the first team's: 20 of 25
    # lets one more request in (30 after it), then refuses.
    other = team_key(pc, first, "uma")
    assert chat(pc, other).status_code == 200
    assert chat(pc, other).status_code == 429
    assert chat(pc, key).status_code == 200  # the moved key is the second team's (10 of 1,000)
