"""A database made by the released 0.1.0 migrates forward with everything in it: users (passwords,
groups, permissions, a signed-in session), API keys, nodes, artifacts, jobs, instances and events.

0.1.0 is commit 239d058. Its tree is exported from git, and its own manage.py migrates a fresh
database and fills it; then this tree's manage.py migrates the same database and reads it back.
The upgraded database must hold every row it held, be shaped exactly like a fresh database of
this version, and let the old password, key and session in.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import tarfile
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.conftest import REPO
from tests.procs import PYTHON

RELEASE = "239d058"  # 0.1.0
ADMIN_PASSWORD = "admin-pass-0.1.0"
VIEWER_PASSWORD = "viewer-pass-0.1.0"
MOVED = {("xgenconsole", "user"): "accounts", ("xgenconsole", "apikey"): "accounts"}

# Run by 0.1.0's manage.py: the rows its users would have made.
FILL = """
import json
from django.contrib.auth.models import Group, Permission
from django.test import Client
from hardware.models import GpuDevice, Heartbeat, Node
from hub.models import CacheEntry, DownloadJob, ModelArtifact
from serving.models import InstanceEvent, ModelInstance
from xgenconsole.models import ApiKey, User
from xgenconsole.services import create_api_key, revoke_api_key

admin = User.objects.get(username="admin")
viewer = User.objects.get(username="viewer")
readers = Group.objects.create(name="key-readers")
readers.permissions.add(Permission.objects.get(content_type__app_label="xgenconsole", codename="view_apikey"))
viewer.groups.add(readers)
viewer.user_permissions.add(Permission.objects.get(content_type__app_label="xgenconsole", codename="change_user"))
revoked, revoked_raw = create_api_key(user=viewer, name="old-laptop")
revoke_api_key(key=revoked)

node = Node.objects.create(name="node-a", address="10.0.0.5", backends=["llama_cpp_python"], detector="nvml",
                           cpu_count=16, memory_total_mib=64000)
GpuDevice.objects.create(node=node, index=0, uuid="GPU-0a1b", vendor="NVIDIA", type="NVIDIA", name="H100",
                         arch="9.0", memory_total_mib=81559, memory_used_mib=1024, utilization_pct=3.5)
Heartbeat.objects.create(node=node, gpu_count=1, memory_used_mib=2048, instances_running=1)
artifact = ModelArtifact.objects.create(prefix="gguf/Qwen_Qwen3-4B", format="gguf", name="Qwen3-4B",
                                        files=[{"path": "qwen3-4b.gguf", "size": 2497281, "etag": "e1"}],
                                        size_bytes=2497281, file_count=1, complete=True,
                                        source_repo="Qwen/Qwen3-4B-GGUF", source_revision="main")
CacheEntry.objects.create(node=node, prefix=artifact.prefix, state="READY", bytes_done=2497281,
                          bytes_total=2497281, manifest={"qwen3-4b.gguf": "e1"})
job = DownloadJob.objects.create(repo_id="Qwen/Qwen3-4B-GGUF", revision="main", format="gguf",
                                 allow_patterns=["*.gguf"], status="COMPLETED", bytes_done=2497281,
                                 bytes_total=2497281, target_prefix=artifact.prefix, node="node-a",
                                 created_by=viewer)
instance = ModelInstance.objects.create(model_name="qwen3-4b", model_path=artifact.prefix, artifact=artifact,
                                        backend="llama_cpp_python", node=node, gpus=[0], extra_args={"n_ctx": 4096},
                                        state="READY", port=18001, created_by=admin)
InstanceEvent.objects.create(instance=instance, from_state="PENDING", to_state="LOADING", message="starting")
InstanceEvent.objects.create(instance=instance, from_state="LOADING", to_state="READY", message="healthy")

browser = Client()
signed_in = browser.post("/accounts/login/", {"username": "viewer", "password": PARAMS["viewer_password"]},
                         HTTP_HOST="localhost")
assert signed_in.status_code == 302, signed_in.status_code
print("FILLED " + json.dumps({"admin": admin.pk, "viewer": viewer.pk, "revoked_key": revoked_raw,
                              "session_key": browser.cookies["sessionid"].value, "job": job.pk,
                              "instance": instance.pk}))
"""

# Run by either version: every row of every table, and every table's shape, through Django's
# introspection only (so the same script reads the database before and after).
SNAPSHOT = """
import json
from django.db import connection

rows, schema = {}, {}
with connection.cursor() as cursor:
    for table in sorted(connection.introspection.table_names(cursor)):
        cursor.execute("SELECT * FROM " + connection.ops.quote_name(table))
        names = [d[0] for d in cursor.description]
        if table != "django_migrations":
            rows[table] = [dict(zip(names, row)) for row in cursor.fetchall()]
        columns = sorted([str(v) for v in column] for column in connection.introspection.get_table_description(cursor, table))
        constraints = {name: {k: str(v) for k, v in sorted(c.items())}
                       for name, c in connection.introspection.get_constraints(cursor, table).items()}
        schema[table] = {"columns": columns, "constraints": constraints}
print("SNAPSHOT " + json.dumps({"vendor": connection.vendor, "rows": rows, "schema": schema}, default=str,
                              sort_keys=True))
"""

# Run by this version after the upgrade: the old credentials and links, read through the new models.
CHECK = """
import asyncio, json
from django.contrib.auth import authenticate, get_user, get_user_model
from django.contrib.contenttypes.models import ContentType
from django.contrib.sessions.backends.db import SessionStore
from django.test import Client
from accounts.credentials import authenticate as check_headers, key_cache, lookup_key, session_cache
from accounts.models import ApiKey, User
from hub.models import DownloadJob
from serving.models import ModelInstance

out = {"user_model": get_user_model()._meta.label, "users": User.objects.count()}
for name in ("admin", "viewer"):
    user = authenticate(username=name, password=PARAMS[name + "_password"])
    out[name] = user and [user.pk, user.username, user.role, user.is_staff]
out["wrong_password"] = authenticate(username="viewer", password="not-it-at-all")
principal = lookup_key(PARAMS["key"])
out["key"] = principal and [principal.user_id, principal.role]
out["revoked_key"] = lookup_key(PARAMS["revoked_key"])
key_cache.clear()
session_cache.clear()
out["header_key"] = asyncio.run(check_headers({b"authorization": b"Bearer " + PARAMS["key"].encode()},
                                              method="GET")).user_id
cookie = ("sessionid=" + PARAMS["session_key"]).encode()
out["header_session"] = asyncio.run(check_headers({b"cookie": cookie}, method="GET")).user_id

class Request:
    session = SessionStore(PARAMS["session_key"])

out["session_user"] = get_user(Request).pk
browser = Client()
browser.cookies["sessionid"] = PARAMS["session_key"]
out["session_page"] = browser.get("/instances/", HTTP_HOST="localhost").status_code
admin_browser = Client()
out["login"] = admin_browser.post("/accounts/login/", {"username": "admin", "password": PARAMS["admin_password"]},
                                  HTTP_HOST="localhost").status_code
out["users_page"] = admin_browser.get("/users/", HTTP_HOST="localhost").status_code
viewer = User.objects.get(username="viewer")
out["viewer_perms"] = sorted(viewer.get_all_permissions())
out["viewer_groups"] = list(viewer.groups.values_list("name", flat=True))
out["content_types"] = sorted(ContentType.objects.filter(app_label__in=["xgenconsole", "accounts"])
                              .values_list("app_label", "model"))
out["keys"] = sorted(ApiKey.objects.values_list("name", "user__username"))
job = DownloadJob.objects.get(pk=PARAMS["job"])
out["job_created_by"] = job.created_by.username
instance = ModelInstance.objects.get(pk=PARAMS["instance"])
out["instance"] = [instance.created_by.username, instance.node.name, instance.artifact.prefix,
                   list(instance.events.values_list("to_state", flat=True))]
out["created_by"] = sorted(User.objects.filter(modelinstance__isnull=False).values_list("username", flat=True))
print("CHECKED " + json.dumps(out, default=str))
"""


# ---------------------------------------------------------------- running either version
def _env(data_dir: Path, database_url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("XGEN_", "DATABASE_URL", "REDIS_URL", "MINIO_", "DJANGO_"))}
    env.update(DJANGO_SETTINGS_MODULE="xgenconsole.settings", XGEN_DATA_DIR=str(data_dir),
               XGEN_SECRET_KEY="migrate-from-0.1.0-" + "s" * 40, XGEN_DEMO_MODEL="false")
    if database_url:
        env["DATABASE_URL"] = database_url
    return env


def _manage(tree: Path, env: dict[str, str], *args: str) -> str:
    done = subprocess.run([PYTHON, str(tree / "manage.py"), *args], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{tree.name}: manage.py {args[0]} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _shell(tree: Path, env: dict[str, str], script: str, marker: str, **params) -> dict:
    code = f"PARAMS = {json.dumps(params)}\n{script}"
    out = _manage(tree, env, "shell", "-v", "0", "-c", code)
    lines = [line for line in out.splitlines() if line.startswith(marker + " ")]
    assert len(lines) == 1, out
    return json.loads(lines[0][len(marker) + 1:])


@pytest.fixture(scope="module")
def release_tree(tmp_path_factory) -> Path:
    """The 0.1.0 source tree, exported from this repository's history."""
    tree = export_release(RELEASE, "0.1.0", tmp_path_factory)
    assert (tree / "xgenconsole" / "models.py").is_file() and not (tree / "accounts").exists()
    return tree


def export_release(commit: str, version: str, tmp_path_factory) -> Path:
    """A released source tree (`git archive` of its commit: no network) in a temp dir."""
    found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    if found.returncode != 0:
        pytest.fail(f"the {version} release (commit {commit}) is not in {REPO}'s git history; this test needs "
                    f"a clone with history (git fetch --unshallow)")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True).stdout
    tree = tmp_path_factory.mktemp(f"xgen-{version}")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


# ---------------------------------------------------------------- what must hold
# Tables whose rows moved into another, under their ids: download jobs are hub_job rows since
# hub 0007 (one job model, issue 24 #4).
MERGED = {"hub_downloadjob": "hub_job"}


def _rows_kept(before: dict[str, list[dict]], after: dict[str, list[dict]]) -> list[str]:
    """Rows of `before` that `after` lacks (compared on the columns they had); content types
    of the moved models are expected under their new app label."""
    lost = []
    for table, rows in before.items():
        table = MERGED.get(table, table)
        if table not in after:
            lost.append(f"table {table} is gone")
            continue
        expected = []
        for row in rows:
            if table == "django_content_type" and (row["app_label"], row["model"]) in MOVED:
                row = {**row, "app_label": MOVED[row["app_label"], row["model"]]}
            expected.append(json.dumps(row, sort_keys=True))
        columns = set(rows[0]) if rows else set()
        present = [json.dumps({k: v for k, v in row.items() if k in columns}, sort_keys=True) for row in after[table]]
        missing = Counter(expected) - Counter(present)
        lost.extend(f"{table}: {row}" for row in missing.elements())
    return lost


# The key limits (accounts 0003) and the key scopes (accounts 0005, issue 34 #20).
# The key limits (accounts 0003), and the team that owns a key (accounts 0007, issue 26).
KEY_LIMIT_COLUMNS = {"allowed_models", "rpm", "tpm", "daily_tokens", "monthly_tokens", "priority", "scopes", "team_id"}
SSO_USER_COLUMNS = {"local_role", "idp_source", "idp_subject", "idp_groups", "idp_role", "idp_synced_at"}


def _upgrade(tmp_path: Path, release_tree: Path, *, database_url: str | None = None,
             fresh_database_url: str | None = None) -> None:
    old_env = _env(tmp_path / "data", database_url)
    # 0.1.0 makes its database and fills it, through its own commands and models.
    _manage(release_tree, old_env, "migrate", "-v", "0")
    _manage(release_tree, old_env, "createuser", "--username", "admin", "--role", "admin",
            "--password", ADMIN_PASSWORD, "--email", "admin@example.org")
    _manage(release_tree, old_env, "createuser", "--username", "viewer", "--role", "viewer",
            "--password", VIEWER_PASSWORD)
    key = _manage(release_tree, old_env, "createapikey", "--username", "admin", "--name", "ci").strip()
    filled = _shell(release_tree, old_env, FILL, "FILLED", viewer_password=VIEWER_PASSWORD)
    before = _shell(release_tree, old_env, SNAPSHOT, "SNAPSHOT")
    assert before["vendor"] == ("postgresql" if database_url else "sqlite")
    assert len(before["rows"]["xgenconsole_user"]) == 2 and len(before["rows"]["xgenconsole_apikey"]) == 2
    assert len(before["rows"]["django_session"]) == 1

    # This version migrates the same database.
    new_env = _env(tmp_path / "data", database_url)
    _manage(REPO, new_env, "migrate", "-v", "0")
    after = _shell(REPO, new_env, SNAPSHOT, "SNAPSHOT")
    assert _rows_kept(before["rows"], after["rows"]) == []
    for table in ("xgenconsole_user_groups", "xgenconsole_user_user_permissions"):
        assert after["schema"][table] == before["schema"][table], f"{table} changed shape"
    # Single sign-on (accounts 0006, issue 26) adds columns to users, and one constraint (an IdP's
    # subject names one user); every 0.1.0 user is local, its role its local role.
    old_users, new_users = before["schema"]["xgenconsole_user"], after["schema"]["xgenconsole_user"]
    assert [c for c in old_users["columns"] if c not in new_users["columns"]] == []
    assert {k: v for k, v in old_users["constraints"].items() if new_users["constraints"].get(k) != v} == {}
    assert {c[0] for c in new_users["columns"]} - {c[0] for c in old_users["columns"]} == SSO_USER_COLUMNS
    added = [v for v in new_users["constraints"].values() if v not in old_users["constraints"].values()]
    # (SQLite's JSON_VALID check on idp_groups is a constraint there too.)
    assert sorted(v["columns"] for v in added if v["check"] == "False") == ["['idp_source', 'idp_subject']"], added
    assert {v["columns"] for v in added if v["check"] == "True"} <= {"['idp_groups', 'idp_groups']"}, added
    assert sorted((u["username"], u["local_role"], u["idp_source"]) for u in after["rows"]["xgenconsole_user"]) == [
        ("admin", "admin", ""), ("viewer", "viewer", "")]
    # 0.2 adds columns to instances (the launch plan, the replica number, aliases) and the key
    # limits to the keys table (accounts 0003): every 0.1.0 column and constraint (the foreign
    # keys included) is still there, unchanged.
    for table in ("serving_modelinstance", "xgenconsole_apikey"):
        kept, now = before["schema"][table], after["schema"][table]
        assert [c for c in kept["columns"] if c not in now["columns"]] == [], f"{table} lost a column"
        # By definition, not by name: SQLite names foreign keys by position (fk_0, fk_1, ...), and
        # a table that gains one (the keys' team, accounts 0007) renumbers the others.
        assert [v for v in kept["constraints"].values() if v not in now["constraints"].values()] == [], table
    # Download jobs are rows of hub_job since hub 0007 (one job model for every kind): each
    # column a 0.1.0 download job had is there, of the same type.
    kept, now = before["schema"]["hub_downloadjob"], after["schema"]["hub_job"]
    assert [c for c in kept["columns"] if c not in now["columns"]] == [], "hub_job lacks a download job's column"
    assert "hub_downloadjob" not in after["schema"]
    old_keys, new_keys = before["schema"]["xgenconsole_apikey"], after["schema"]["xgenconsole_apikey"]
    assert {c[0] for c in new_keys["columns"]} - {c[0] for c in old_keys["columns"]} == KEY_LIMIT_COLUMNS

    # ...and a fresh database of this version has exactly the upgraded one's shape.
    fresh_env = _env(tmp_path / "fresh", fresh_database_url)
    _manage(REPO, fresh_env, "migrate", "-v", "0")
    fresh = _shell(REPO, fresh_env, SNAPSHOT, "SNAPSHOT")
    assert after["schema"] == fresh["schema"]

    # Nothing left to migrate or to make, on the upgraded database.
    _manage(REPO, new_env, "migrate", "--check")
    assert "No changes detected" in _manage(REPO, new_env, "makemigrations", "--check", "--dry-run")

    checked = _shell(REPO, new_env, CHECK, "CHECKED", key=key, admin_password=ADMIN_PASSWORD,
                     viewer_password=VIEWER_PASSWORD, **filled)
    admin, viewer = filled["admin"], filled["viewer"]
    assert checked["user_model"] == "accounts.User" and checked["users"] == 2
    assert checked["admin"] == [admin, "admin", "admin", True]
    assert checked["viewer"] == [viewer, "viewer", "viewer", False]
    assert checked["wrong_password"] is None
    assert checked["key"] == [admin, "admin"] and checked["revoked_key"] is None
    assert checked["header_key"] == admin and checked["header_session"] == viewer
    assert checked["session_user"] == viewer and checked["session_page"] == 200
    assert checked["login"] == 302 and checked["users_page"] == 200
    assert checked["viewer_perms"] == ["accounts.change_user", "accounts.view_apikey"]
    assert checked["viewer_groups"] == ["key-readers"]
    assert checked["content_types"] == [["accounts", "apikey"], ["accounts", "auditevent"], ["accounts", "team"],
                                        ["accounts", "teammembership"], ["accounts", "user"]]
    assert checked["keys"] == [["ci", "admin"], ["old-laptop", "viewer"]]
    assert checked["job_created_by"] == "viewer"
    assert checked["instance"] == ["admin", "node-a", "gguf/Qwen_Qwen3-4B", ["LOADING", "READY"]]
    assert checked["created_by"] == ["admin"]


def test_a_0_1_0_sqlite_database_migrates_with_every_row(tmp_path, release_tree):
    _upgrade(tmp_path, release_tree)


# ---------------------------------------------------------------- PostgreSQL
def _pg(sql: str) -> None:
    import psycopg

    from tests.cluster.harness import PG_ADMIN_DSN

    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql)


@contextlib.contextmanager
def postgres_databases() -> Iterator[tuple[str, str]]:
    """URLs of two new databases on the loopback PostgreSQL (one to upgrade, one fresh), dropped after."""
    from tests.cluster.harness import PG_ADMIN_DSN, services_available

    missing = services_available()
    if missing:
        pytest.fail(f"this test needs PostgreSQL on loopback (.ci/run starts it): {missing}")
    suffix = uuid.uuid4().hex[:10]
    upgraded, fresh = f"xgen_mig_{suffix}", f"xgen_mig_{suffix}_fresh"
    admin = urlsplit(PG_ADMIN_DSN)

    def url(database: str) -> str:
        return urlunsplit(admin._replace(path=f"/{database}"))

    for database in (upgraded, fresh):
        _pg(f'CREATE DATABASE "{database}"')
    try:
        yield url(upgraded), url(fresh)
    finally:
        for database in (upgraded, fresh):
            _pg(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


@pytest.mark.cluster
def test_a_0_1_0_postgresql_database_migrates_with_every_row(tmp_path, release_tree):
    with postgres_databases() as (upgraded, fresh):
        _upgrade(tmp_path, release_tree, database_url=upgraded, fresh_database_url=fresh)
