"""A database made by the released 0.2.0 migrates forward with everything in it: users, keys with
their limits, the audit log, nodes and their GPUs, the model index, node caches and cache jobs,
download and upload jobs, instances with their launch plans, aliases and on-demand settings,
their timelines, memory measurements, usage buckets, the request log and the history samples.

0.2.0 is commit 7a3a6ad. As for 0.1.0 (test_migrate_from_0_1_0.py, whose helpers this reuses):
its tree is exported from git, its own manage.py makes a fresh database and its own code fills
it; then this tree's manage.py migrates the same database, every row must still be there, the
shape must be a fresh database's, and this version's code must read the old rows (sign-in, the
key and its limits, the session, the instance, the usage and request-log APIs).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.accounts.test_migrate_from_0_1_0 import (
    SNAPSHOT,
    _env,
    _manage,
    _rows_kept,
    _shell,
    export_release,
    postgres_databases,
)
from tests.conftest import REPO

RELEASE = "7a3a6ad"  # 0.2.0
ADMIN_PASSWORD = "admin-pass-0.2.0"
VIEWER_PASSWORD = "viewer-pass-0.2.0"

# Run by 0.2.0's manage.py: the rows its users and its agents would have made, through its code.
FILL = """
import json
from datetime import timedelta
from django.contrib.auth.models import Group, Permission
from django.test import Client
from django.utils import timezone
from accounts.audit import record_audit
from accounts.models import User
from accounts.services import create_api_key, revoke_api_key
from hardware.models import GpuDevice, Heartbeat
from hardware.services import register_node
from history.models import ModelSample, ResourceSample
from hub.models import CacheDisk, CacheEntry, CacheJob, DownloadJob, ModelArtifact, UploadJob
from serving.models import MemoryMeasurement, ModelInstance, RequestLog, UsageBucket

admin = User.objects.get(username="admin")
viewer = User.objects.get(username="viewer")
readers = Group.objects.create(name="key-readers")
readers.permissions.add(Permission.objects.get(content_type__app_label="accounts", codename="view_apikey"))
viewer.groups.add(readers)
limited, limited_raw = create_api_key(user=viewer, name="chat-only", allowed_models=["qwen3-4b"], rpm=60,
                                      tpm=100000, daily_tokens=2000000, monthly_tokens=30000000, priority=7)
revoked, revoked_raw = create_api_key(user=viewer, name="old-laptop")
revoke_api_key(key=revoked)
record_audit(action="key_create", actor=admin, target="chat-only", detail={"user": "viewer"})

node = register_node(name="node-a", address="10.0.0.5")
node.backends = [{"name": "llama-cpp-python", "available": True, "version": "0.3.16", "flavour": "cpu",
                  "path": "", "reason": ""}]
node.detector, node.cpu_count, node.memory_total_mib, node.model_memory_mib = "nvml", 16, 64000, 48000
node.save()
GpuDevice.objects.create(node=node, index=0, uuid="GPU-0a1b", vendor="NVIDIA", type="NVIDIA", name="H100",
                         arch="9.0", memory_total_mib=81559, memory_used_mib=1024, utilization_pct=3.5)
Heartbeat.objects.create(node=node, gpu_count=1, memory_used_mib=2048, instances_running=1)
artifact = ModelArtifact.objects.create(prefix="gguf/Qwen_Qwen3-4B", format="gguf", name="Qwen3-4B",
                                        files=[{"path": "qwen3-4b.gguf", "size": 2497281, "etag": "e1"}],
                                        size_bytes=2497281, file_count=1, complete=True,
                                        source_repo="Qwen/Qwen3-4B-GGUF", source_revision="main")
CacheEntry.objects.create(node=node, prefix=artifact.prefix, state="READY", bytes_done=2497281,
                          bytes_total=2497281, manifest={"qwen3-4b.gguf": "e1"}, last_used_at=timezone.now())
CacheDisk.objects.create(node=node, used_bytes=2497281, free_bytes=10**11, total_bytes=2 * 10**11)
cache_job = CacheJob.objects.create(node="node-a", prefix=artifact.prefix, action="verify", status="COMPLETED",
                                    result={"problems": []}, created_by=admin, finished_at=timezone.now())
download = DownloadJob.objects.create(repo_id="Qwen/Qwen3-4B-GGUF", revision="main", format="gguf",
                                      allow_patterns=["*.gguf"], status="COMPLETED", bytes_done=2497281,
                                      bytes_total=2497281, target_prefix=artifact.prefix, node="node-a",
                                      created_by=viewer)
upload = UploadJob.objects.create(local_path="/srv/models/tiny", format="gguf", target_prefix="gguf/tiny",
                                  node="node-a", status="FAILED", error="disk full", created_by=admin)
plan = {"backend": "llama-cpp-python", "command": ["python", "-m", "llama_cpp.server"], "env": {}}
instance = ModelInstance.create_requested(
    message="load requested", announce=False, model_name="qwen3-4b", aliases=["qwen", "chat"],
    model_path=artifact.prefix, artifact=artifact, backend="llama-cpp-python", node=node, gpus=[0],
    extra_args={"n_ctx": 4096}, plan=plan, policy="on_demand", idle_ttl_s=900, pinned=True, max_concurrency=4,
    estimated_memory_mib=3000, created_by=admin)
ModelInstance.objects.filter(pk=instance.pk).update(state="READY", port=18001, measured_memory_mib=2900,
                                                    measured_source="nvml", last_request_at=timezone.now())
MemoryMeasurement.objects.create(model_path=artifact.prefix, backend="llama-cpp-python (cpu)", ctx=4096,
                                 measured_mib=2900, source="nvml", node_name="node-a")
hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
UsageBucket.objects.create(bucket_start=hour, key_id=limited.pk, key_name="chat-only", username="viewer",
                           model="qwen3-4b", instance_id=instance.pk, node="node-a", requests=3, errors=1,
                           prompt_tokens=120, completion_tokens=45, busy_seconds=2.5)
RequestLog.objects.create(at=hour + timedelta(minutes=5), request_id="req-0.2.0", key_id=limited.pk,
                          key_name="chat-only", username="viewer", model="qwen3-4b", instance_id=instance.pk,
                          node="node-a", status=200, ttft_ms=35.0, duration_ms=420.0, prompt_tokens=40,
                          completion_tokens=15, stream=True, client="10.0.0.9")
ResourceSample.objects.create(step=60, at=int(hour.timestamp()), node="node-a", gpu=0, mem_used_mib=2900,
                              mem_total_mib=81559, util_pct=12.0)
ModelSample.objects.create(step=60, at=int(hour.timestamp()), model="qwen3-4b", requests=3, errors=1,
                           prompt_tokens=120, completion_tokens=45, latency_hist=[0, 3], ttft_hist=[3])

browser = Client()
signed_in = browser.post("/accounts/login/", {"username": "viewer", "password": PARAMS["viewer_password"]},
                         HTTP_HOST="localhost")
assert signed_in.status_code == 302, signed_in.status_code
print("FILLED " + json.dumps({"admin": admin.pk, "viewer": viewer.pk, "limited_key": limited_raw,
                              "limited_key_id": limited.pk, "revoked_key": revoked_raw,
                              "session_key": browser.cookies["sessionid"].value, "download": download.pk,
                              "upload": upload.pk, "cache_job": cache_job.pk, "instance": instance.pk}))
"""

# Run by this version after the upgrade: the old rows, read through the new code.
CHECK = """
import json
from django.contrib.auth import authenticate
from django.test import Client
from accounts.credentials import key_cache, lookup_key
from serving.models import ModelInstance

out = {}
for name in ("admin", "viewer"):
    user = authenticate(username=name, password=PARAMS[name + "_password"])
    out[name] = user and [user.pk, user.role]
key_cache.clear()
admin_key = lookup_key(PARAMS["admin_key"])
out["admin_key"] = admin_key and [admin_key.user_id, sorted(admin_key.scopes)]
limited = lookup_key(PARAMS["limited_key"])
out["limited_key"] = limited and [limited.user_id, sorted(limited.allowed_models or []), limited.rpm, limited.tpm,
                                  limited.daily_tokens, limited.monthly_tokens, limited.priority,
                                  sorted(limited.scopes)]
out["revoked_key"] = lookup_key(PARAMS["revoked_key"])
browser = Client()
browser.cookies["sessionid"] = PARAMS["session_key"]
out["session_page"] = browser.get("/instances/", HTTP_HOST="localhost").status_code
api = Client(HTTP_AUTHORIZATION="Bearer " + PARAMS["admin_key"], HTTP_HOST="localhost")
usage = api.get("/api/usage", {"group_by": "key"})
out["usage"] = [usage.status_code, [[i.get("key_id"), i["requests"], i["errors"], i["prompt_tokens"],
                                     i["completion_tokens"]] for i in usage.json()["items"]]]
logged = api.get("/api/requests")
out["requests"] = [logged.status_code, [[i["request_id"], i["status"], i["prompt_tokens"], i["completion_tokens"]]
                                        for i in logged.json()["items"]]]
out["audit"] = api.get("/api/audit").status_code
instance = ModelInstance.objects.get(pk=PARAMS["instance"])
out["instance"] = [instance.model_name, instance.aliases, instance.policy, instance.idle_ttl_s, instance.pinned,
                   instance.max_concurrency, instance.plan["backend"], instance.state, instance.node.name,
                   instance.created_by.username, list(instance.events.values_list("to_state", flat=True))]
download = api.get(f"/api/download/{PARAMS['download']}").json()
out["download"] = [download["id"], download["repo_id"], download["status"]]
upload = api.get(f"/api/storage/uploads/{PARAMS['upload']}").json()
out["upload"] = [upload["id"], upload["status"], upload["error"], upload["created_by"]]
cache_job = api.get(f"/api/hardware/nodes/node-a/cache/jobs/{PARAMS['cache_job']}").json()
out["cache_job"] = [cache_job["id"], cache_job["action"], cache_job["prefix"], cache_job["result"]]
print("CHECKED " + json.dumps(out, default=str))
"""


# Upload, download and cache jobs are rows of one table since hub 0007 (issue 24 #4), with their
# kind, their old id as `number` and a cache job's prefix as target_prefix.
JOB_TABLES = {"hub_downloadjob": ("download", {}), "hub_uploadjob": ("upload", {}),
              "hub_cachejob": ("cache", {"prefix": "target_prefix"})}


def _jobs_kept(before: dict[str, list[dict]], jobs: list[dict]) -> list[str]:
    """Rows of the three 0.2.0 job tables that hub_job lacks (compared on the columns they had)."""
    lost = []
    for table, (kind, renamed) in JOB_TABLES.items():
        for row in before[table]:
            want = {renamed.get(k, k): v for k, v in row.items() if k != "id"} | {"kind": kind, "number": row["id"]}
            if not any(all(job.get(k) == v for k, v in want.items()) for job in jobs):
                lost.append(f"{table}: {row}")
    return lost


@pytest.fixture(scope="module")
def release_tree(tmp_path_factory) -> Path:
    """The 0.2.0 source tree, exported from this repository's history."""
    tree = export_release(RELEASE, "0.2.0", tmp_path_factory)
    assert (tree / "accounts" / "models.py").is_file() and (tree / "history").is_dir()
    return tree


def _upgrade(tmp_path: Path, release_tree: Path, *, database_url: str | None = None,
             fresh_database_url: str | None = None) -> None:
    old_env = _env(tmp_path / "data", database_url)
    # 0.2.0 makes its database and fills it, through its own commands and code.
    _manage(release_tree, old_env, "migrate", "-v", "0")
    for name, role, password in (("admin", "admin", ADMIN_PASSWORD), ("viewer", "viewer", VIEWER_PASSWORD)):
        _manage(release_tree, old_env, "createuser", "--username", name, "--role", role, "--password", password)
    admin_key = _manage(release_tree, old_env, "createapikey", "--username", "admin", "--name", "ci").strip()
    filled = _shell(release_tree, old_env, FILL, "FILLED", viewer_password=VIEWER_PASSWORD)
    before = _shell(release_tree, old_env, SNAPSHOT, "SNAPSHOT")
    assert before["vendor"] == ("postgresql" if database_url else "sqlite")
    for table, count in (("xgenconsole_user", 2), ("xgenconsole_apikey", 3), ("accounts_auditevent", 1),
                         ("serving_modelinstance", 1), ("serving_usagebucket", 1), ("serving_requestlog", 1),
                         ("hub_uploadjob", 1), ("history_modelsample", 1), ("django_session", 1)):
        assert len(before["rows"][table]) >= count, table  # the commands and the sign-in audit too

    # This version migrates the same database: every row kept, on the columns it had.
    new_env = _env(tmp_path / "data", database_url)
    _manage(REPO, new_env, "migrate", "-v", "0")
    after = _shell(REPO, new_env, SNAPSHOT, "SNAPSHOT")
    others = {table: rows for table, rows in before["rows"].items() if table not in JOB_TABLES}
    assert _rows_kept(others, after["rows"]) == []
    assert _jobs_kept(before["rows"], after["rows"]["hub_job"]) == []
    for table, kept in before["schema"].items():  # every 0.2.0 column is still there, unchanged
        if table in JOB_TABLES:
            kind, renamed = JOB_TABLES[table]
            now = after["schema"]["hub_job"]
            kept = {"columns": [[renamed.get(c[0], c[0]), *c[1:]] for c in kept["columns"] if c[0] != "id"]}
            assert table not in after["schema"]
        else:
            now = after["schema"].get(table, {"columns": []})
        assert [c for c in kept["columns"] if c not in now["columns"]] == [], f"{table} lost or changed a column"

    # ...shaped exactly like a fresh database of this version, with nothing left to migrate or make.
    fresh_env = _env(tmp_path / "fresh", fresh_database_url)
    _manage(REPO, fresh_env, "migrate", "-v", "0")
    assert after["schema"] == _shell(REPO, fresh_env, SNAPSHOT, "SNAPSHOT")["schema"]
    _manage(REPO, new_env, "migrate", "--check")
    assert "No changes detected" in _manage(REPO, new_env, "makemigrations", "--check", "--dry-run")

    checked = _shell(REPO, new_env, CHECK, "CHECKED", admin_key=admin_key, admin_password=ADMIN_PASSWORD,
                     viewer_password=VIEWER_PASSWORD, **filled)
    admin, viewer = filled["admin"], filled["viewer"]
    assert checked["admin"] == [admin, "admin"] and checked["viewer"] == [viewer, "viewer"]
    # Keys made before scopes (accounts 0005) have all three; the limits are as 0.2.0 stored them.
    assert checked["admin_key"] == [admin, ["inference", "manage", "read"]]
    assert checked["limited_key"] == [viewer, ["qwen3-4b"], 60, 100000, 2000000, 30000000, 7,
                                      ["inference", "manage", "read"]]
    assert checked["revoked_key"] is None
    assert checked["session_page"] == 200
    assert checked["usage"] == [200, [[filled["limited_key_id"], 3, 1, 120, 45]]]
    assert checked["requests"] == [200, [["req-0.2.0", 200, 40, 15]]]
    assert checked["audit"] == 200
    assert checked["instance"] == ["qwen3-4b", ["qwen", "chat"], "on_demand", 900, True, 4, "llama-cpp-python",
                                   "READY", "node-a", "admin", ["PENDING"]]
    # The three job tables are one since hub 0007; each job keeps its id in its kind's API.
    assert checked["download"] == [filled["download"], "Qwen/Qwen3-4B-GGUF", "COMPLETED"]
    assert checked["upload"] == [filled["upload"], "FAILED", "disk full", "admin"]
    assert checked["cache_job"] == [filled["cache_job"], "verify", "gguf/Qwen_Qwen3-4B", {"problems": []}]


def test_a_0_2_0_sqlite_database_migrates_with_every_row(tmp_path, release_tree):
    _upgrade(tmp_path, release_tree)


@pytest.mark.cluster
def test_a_0_2_0_postgresql_database_migrates_with_every_row(tmp_path, release_tree):
    with postgres_databases() as (upgraded, fresh):
        _upgrade(tmp_path, release_tree, database_url=upgraded, fresh_database_url=fresh)
