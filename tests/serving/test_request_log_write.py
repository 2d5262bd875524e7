"""The request log's rows as the usage writer inserts them (one prepared INSERT, not the ORM's
bulk_create): every field reads back as it was counted, on SQLite and on PostgreSQL."""
from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

import pytest
from django.db import connections

from accounts.credentials import Principal
from serving.models import RequestLog
from serving.proxy.usage import ROW_FIELDS, RequestContext, UsageRecorder, _insert_request_rows
from tests.cluster.harness import PG_ADMIN_DSN, _pg_admin
from xgenconsole.env import database_from_url

FIELDS = ("request_id", "key_id", "key_name", "username", "model", "instance_id", "node", "status", "error",
          "ttft_ms", "duration_ms", "prompt_tokens", "completion_tokens", "stream", "client", "client_request_id",
          "usage_source", "team_id", "team_slug", "resumes")


def _rows() -> list[dict]:
    at = time.time()
    return [
        {"at": at, "request_id": "req-1", "key_id": 7, "key_name": "team 'a' key", "username": "ada",
         "model": "smol-ü \"chat\"", "instance_id": 3, "node": "node-a", "status": 200, "error": "",
         "ttft_ms": 12.34, "duration_ms": 56.78, "prompt_tokens": 5, "completion_tokens": 100, "stream": True,
         "client": "10.0.0.1", "client_request_id": "trace 'b'/42", "usage_source": "console", "team_id": 4,
         "team_slug": "team-a", "resumes": 1},
        {"at": at + 0.000123, "request_id": "req-2", "key_id": 0, "key_name": "", "username": "", "model": "",
         "instance_id": None, "node": "", "status": 429, "error": "rate_limited", "ttft_ms": None,
         "duration_ms": 0.5, "prompt_tokens": 0, "completion_tokens": 0, "stream": False, "client": "",
         "client_request_id": "", "usage_source": "engine", "team_id": 0, "team_slug": "",
         "resumes": 0},
    ]


def _tuples(rows: list[dict]) -> list[tuple]:
    return [tuple(row[name] for name in ROW_FIELDS) for row in rows]


def _check(rows: list[dict], stored: list[dict]) -> None:
    assert len(stored) == len(rows)
    for want, got in zip(rows, stored, strict=True):
        assert got["at"] == datetime.fromtimestamp(want["at"], tz=UTC)
        assert {f: got[f] for f in FIELDS} == {f: want[f] for f in FIELDS}


@pytest.mark.django_db
def test_counted_requests_read_back_whole():
    recorder = UsageRecorder()
    ada = Principal(user_id=1, username="ada", role="viewer", key_id=7, key_name="team 'a' key")
    ctx = RequestContext(request_id="req-1", client="10.0.0.1", principal=ada, stream=True)
    recorder.record(ctx, model="smol-ü \"chat\"", instance_id=3, node="node-a", status=200, error=None,
                    prompt_tokens=5, completion_tokens=100, busy_s=0.25, ttft_s=0.01234, failed=False,
                    ended=ctx.t0 + 0.0567)
    refused = RequestContext(request_id="req-2", principal=ada, model="other")
    recorder.record_refused(refused, status=429, code="rate_limited")
    # two hour buckets (the answered request's and the refusal's: a refusal counts as an error of the
    # key, issue 35 #7), two request rows
    assert recorder.flush_sync() == 4
    stored = list(RequestLog.objects.order_by("pk").values())
    assert [r["request_id"] for r in stored] == ["req-1", "req-2"]
    first, second = stored
    assert (first["username"], first["key_id"], first["key_name"], first["model"], first["node"]) == (
        "ada", 7, "team 'a' key", "smol-ü \"chat\"", "node-a")
    assert (first["status"], first["prompt_tokens"], first["completion_tokens"], first["stream"]) == (200, 5, 100, True)
    assert first["ttft_ms"] == 12.34 and first["duration_ms"] == 56.7 and first["client"] == "10.0.0.1"
    assert first["at"] == datetime.fromtimestamp(ctx.at, tz=UTC)
    assert (second["status"], second["error"], second["model"], second["instance_id"], second["ttft_ms"],
            second["stream"]) == (429, "rate_limited", "other", None, None, False)


@pytest.mark.django_db
def test_the_insert_writes_every_field_on_sqlite():
    rows = _rows()
    _insert_request_rows(RequestLog, _tuples(rows))
    _check(rows, list(RequestLog.objects.order_by("pk").values()))


@pytest.mark.cluster
def test_the_insert_writes_every_field_on_postgresql(django_db_blocker, tmp_path):
    try:
        _pg_admin("SELECT 1")
    except Exception as exc:
        pytest.fail(f"this test needs PostgreSQL at {PG_ADMIN_DSN} (.ci/run starts it): {exc}")
    database, alias = f"xgen_rlog_{uuid.uuid4().hex[:10]}", "rlog_pg"
    _pg_admin(f'CREATE DATABASE "{database}"')
    try:
        entry = database_from_url(f"{PG_ADMIN_DSN.rsplit('/', 1)[0]}/{database}", data_dir=tmp_path)
        connections.settings[alias] = connections.configure_settings({"default": {}, alias: entry})[alias]
        with django_db_blocker.unblock():
            with connections[alias].schema_editor() as editor:
                editor.create_model(RequestLog)
            rows = _rows()
            _insert_request_rows(RequestLog, _tuples(rows), using=alias)
            _check(rows, list(RequestLog.objects.using(alias).order_by("pk").values()))
            connections[alias].close()
    finally:
        connections.settings.pop(alias, None)
        _pg_admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def test_row_fields_name_every_request_log_field():
    """A field added to RequestLog and not to ROW_FIELDS would be written as its default, or
    shift the others: the writer refuses such a list."""
    assert set(ROW_FIELDS) == {f.name for f in RequestLog._meta.concrete_fields if not f.primary_key}
    assert ROW_FIELDS[0] == "at"
