"""Migration 0021 (issue 26): usage buckets and request-log rows name the team that owned the key
when the request was made. Rows written before it name the team that owns their key at the upgrade
(what the console read for them until then); a key without a team, and a session's rows, name none."""
from __future__ import annotations

import pytest
from django.utils import timezone

from tests.migrations import latest as _latest
from tests.migrations import migrate_to as _migrate

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("serving", "0020_adapters"), ("accounts", "0008_team_gpu_budget_enforced")]


def test_rows_before_the_upgrade_name_their_keys_team():
    apps = _migrate(BEFORE)
    try:
        User = apps.get_model("accounts", "User")
        Team = apps.get_model("accounts", "Team")
        ApiKey = apps.get_model("accounts", "ApiKey")
        Bucket = apps.get_model("serving", "UsageBucket")
        Log = apps.get_model("serving", "RequestLog")
        user = User.objects.create(username="old-user")
        team = Team.objects.create(name="ML", slug="ml")
        in_team = ApiKey.objects.create(user=user, name="a", prefix="a", key_hash="h1", team=team)
        alone = ApiKey.objects.create(user=user, name="b", prefix="b", key_hash="h2")
        hour = timezone.now().replace(minute=0, second=0, microsecond=0)
        for key_id in (in_team.pk, alone.pk, 0):
            Bucket.objects.create(bucket_start=hour, key_id=key_id, model="m", requests=1)
            Log.objects.create(at=hour, request_id=f"r{key_id}", key_id=key_id, model="m", status=200)
    finally:
        apps = _migrate(_latest())
    Bucket = apps.get_model("serving", "UsageBucket")
    Log = apps.get_model("serving", "RequestLog")
    want = {in_team.pk: (team.pk, "ml"), alone.pk: (0, ""), 0: (0, "")}
    assert {k: (t, s) for k, t, s in Bucket.objects.values_list("key_id", "team_id", "team_slug")} == want
    assert {k: (t, s) for k, t, s in Log.objects.values_list("key_id", "team_id", "team_slug")} == want
