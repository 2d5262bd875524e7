"""Load, unload and restart in the audit log, from the API and from the pages, with the actor,
the target instance, the outcome (refusals too) and the client address."""
from __future__ import annotations

import pytest
from django.test import Client

from accounts.models import AuditEvent
from tests.conftest import bearer
from tests.serving.conftest import NODE

pytestmark = pytest.mark.django_db


def rows() -> list[tuple]:
    return [(e.action, e.actor, e.target, e.outcome, e.client, e.detail.get("via"))
            for e in AuditEvent.objects.exclude(action__in=["login", "logout"]).order_by("pk")]


def test_from_the_api(node, operator, tiny_gguf):
    c = Client(REMOTE_ADDR="10.9.8.7")

    def post(path: str, body: dict):
        return c.post(f"/api/management/{path}", body, content_type="application/json", **bearer(operator.key))

    iid = post("load", {"model_path": str(tiny_gguf), "model_name": "tiny"}).json()["id"]
    assert post("load", {"model_path": "/etc/hostname", "model_name": "bad"}).status_code == 400
    assert post("restart", {"id": iid}).status_code == 202
    assert post("unload", {"id": iid}).status_code == 202
    assert post("unload", {"id": 999}).status_code == 404
    who, via = operator.user.username, "api"
    target = f"tiny (instance {iid})"
    assert rows() == [("load", who, target, "success", "10.9.8.7", via),
                      ("load", who, "bad", "refused", "10.9.8.7", via),
                      ("restart", who, target, "success", "10.9.8.7", via),
                      ("unload", who, target, "success", "10.9.8.7", via),
                      ("unload", who, "instance 999", "refused", "10.9.8.7", via)]
    refused = AuditEvent.objects.get(action="load", outcome="refused")
    assert "not under XGEN_IMPORT_DIRS" in refused.detail["message"]


def test_from_the_pages(node, operator, tiny_gguf):
    c = Client(REMOTE_ADDR="10.1.1.1")
    c.force_login(operator.user)
    r = c.post("/instances/new/", {"model_path": str(tiny_gguf), "model_name": "paged", "server_type": "llm",
                                   "backend": "auto", "node": NODE, "tensor_parallel_size": "1", "extra_args": ""})
    assert r.status_code == 302, r.content[:500]
    from serving.models import ModelInstance

    iid = ModelInstance.objects.get(model_name="paged").pk
    assert c.post(f"/instances/{iid}/restart").status_code == 302
    assert c.post(f"/instances/{iid}/unload").status_code == 302
    who, target = operator.user.username, f"paged (instance {iid})"
    assert rows() == [("load", who, target, "success", "10.1.1.1", "page"),
                      ("restart", who, target, "success", "10.1.1.1", "page"),
                      ("unload", who, target, "success", "10.1.1.1", "page")]
