"""`manage.py migrate` from several web processes at once on one fresh PostgreSQL database (issue 35,
the docs: every web start migrates, the systemd unit's ExecStartPre and the Deployment's init
container). Django's own migrate takes no lock: two at once failed 3 of 3 tries ("relation
"auth_permission" already exists", a duplicate pg_type key). xgenconsole's migrate holds a
PostgreSQL advisory lock around it: a second one waits, then finds nothing to apply."""
from __future__ import annotations

import os
import secrets
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.cluster.harness import PG_ADMIN_DSN, _pg_admin, services_available
from tests.conftest import REPO
from tests.procs import PYTHON, stop_process

pytestmark = pytest.mark.cluster
# The key xgenconsole/management/commands/migrate.py locks (b"xgenmigr" as a bigint), written out
# here so a changed key in the command cannot pass unnoticed.
LOCK_KEY = int.from_bytes(b"xgenmigr", "big")


@pytest.fixture
def fresh_database() -> Iterator[str]:
    missing = services_available()
    if missing:
        pytest.fail(f"this test needs PostgreSQL on loopback: {missing}")
    name = f"xgen_migrate_{uuid.uuid4().hex[:10]}"
    _pg_admin(f'CREATE DATABASE "{name}"')
    yield f"{PG_ADMIN_DSN.rsplit('/', 1)[0]}/{name}"
    _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _migrate(url: str, data_dir: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "xgenconsole.settings", "DATABASE_URL": url,
           "XGEN_DATA_DIR": str(data_dir), "XGEN_SECRET_KEY": secrets.token_urlsafe(50),
           "XGEN_DEMO_MODEL": "false", "PYTHONPATH": str(REPO)}
    env.pop("XGEN_IMPORT_DIRS", None)  # the test settings' value points at the temp dir holding data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([PYTHON, "manage.py", "migrate", "--noinput", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _has_table(url: str, table: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT to_regclass(%s) IS NOT NULL", [table]).fetchone()[0]


def test_two_migrates_at_once_on_a_fresh_database_both_succeed(fresh_database, tmp_path):
    procs = [_migrate(fresh_database, tmp_path / f"web{i}", "-v0") for i in range(2)]
    results = [_finish(p) for p in procs]
    for code, out in results:
        assert code == 0, f"a migrate started beside another failed:\n{out[-3000:]}"
    # Nothing left to apply: the schema is whole, not half of each.
    check = _migrate(fresh_database, tmp_path / "check", "--check", "-v0")
    code, out = _finish(check)
    assert code == 0, f"migrate --check after both found unapplied migrations:\n{out[-3000:]}"
    assert _has_table(fresh_database, "serving_modelinstance")


def test_a_migrate_waits_for_the_lock_and_touches_nothing_meanwhile(fresh_database, tmp_path):
    holder = psycopg.connect(fresh_database, autocommit=True)
    proc = None
    try:
        holder.execute("SELECT pg_advisory_lock(%s)", [LOCK_KEY])
        proc = _migrate(fresh_database, tmp_path / "web", "-v0")
        # A bigint advisory key shows in pg_locks as classid (high 32 bits) and objid (low 32).
        classid, objid = LOCK_KEY >> 32, LOCK_KEY & 0xFFFFFFFF
        deadline = time.monotonic() + 60
        waiting = False
        while time.monotonic() < deadline and proc.poll() is None:
            waiting = holder.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND classid = %s AND objid = %s AND database = (SELECT oid FROM pg_database "
                "WHERE datname = current_database())", [classid, objid]).fetchone()[0] == 1
            if waiting:
                break
            time.sleep(0.1)
        assert waiting, f"migrate did not wait for the lock (exit {proc.poll()}):\n" + (
            proc.communicate()[0][-3000:] if proc.poll() is not None else "")
        assert proc.poll() is None
        assert not _has_table(fresh_database, "django_migrations"), "migrate wrote while another held the lock"
        holder.execute("SELECT pg_advisory_unlock(%s)", [LOCK_KEY])
        code, out = _finish(proc)
        proc = None
        assert code == 0, out[-3000:]
        assert "another migrate holds the lock" in out
        assert _has_table(fresh_database, "serving_modelinstance")
    finally:
        if proc is not None:
            stop_process(proc, timeout=10)
        holder.close()
