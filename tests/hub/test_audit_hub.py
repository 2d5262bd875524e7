"""Downloads, uploads and model deletes in the audit log, from the API and from the pages."""
from __future__ import annotations

import json

import pytest
from django.test import Client

from accounts.models import AuditEvent
from hub import index
from hub.store import FilesystemModelStore
from tests.conftest import bearer
from tests.hub.conftest import run_uploads

pytestmark = pytest.mark.django_db


def rows(action: str) -> list[tuple]:
    return [(e.actor, e.target, e.outcome, e.detail.get("via"))
            for e in AuditEvent.objects.filter(action=action).order_by("pk")]


def test_from_the_api(hub_dirs, admin, operator, tiny_gguf):
    c = Client()

    def post(path: str, body: dict, key: str):
        return c.post(path, json.dumps(body), content_type="application/json", **bearer(key))

    assert post("/api/download", {"repo_id": "acme/m", "format": "gguf"}, operator.key).status_code == 202
    assert post("/api/download", {"repo_id": "../x", "format": "gguf"}, operator.key).status_code == 400
    body = {"local_path": str(tiny_gguf), "format": "gguf", "name": "up"}
    assert post("/api/storage/upload", body, operator.key).status_code == 202
    assert post("/api/storage/upload", {**body, "local_path": "/nowhere"}, operator.key).status_code == 400
    run_uploads()  # what the node agent does with the queued job
    assert c.delete("/api/storage/models/gguf/up", **bearer(admin.key)).status_code == 200
    assert c.delete("/api/storage/models/gguf/..", **bearer(admin.key)).status_code == 400
    op, ad = operator.user.username, admin.user.username
    assert rows("download") == [(op, "acme/m", "success", "api"), (op, "../x", "refused", "api")]
    assert rows("upload") == [(op, f"gguf/up from {tiny_gguf}", "success", "api"),
                              (op, "gguf/up from /nowhere", "refused", "api")]
    assert rows("model_delete") == [(ad, "gguf/up", "success", "api"), (ad, "gguf/..", "refused", "api")]


@pytest.mark.django_db(transaction=True)
def test_from_the_pages(hub_dirs, admin, tiny_gguf):
    c = Client()
    c.force_login(admin.user)
    assert c.post("/downloads/", {"repo_id": "acme/m", "format": "huggingface"}).status_code == 302
    assert c.post("/models/upload/", {"local_path": str(tiny_gguf), "format": "gguf", "name": "paged"}).status_code == 302
    run_uploads()  # the upload is a job: what the node agent does with it
    assert FilesystemModelStore(hub_dirs / "store").exists("gguf/paged")
    index.refresh_index()
    assert c.post("/models/delete/", {"prefix": "gguf/paged"}).status_code == 302
    who = admin.user.username
    assert rows("download") == [(who, "acme/m", "success", "page")]
    assert rows("upload") == [(who, f"gguf/paged from {tiny_gguf}", "success", "page")]
    assert rows("model_delete") == [(who, "gguf/paged", "success", "page")]
