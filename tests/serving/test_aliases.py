"""Aliases (issue 15 #4): `aliases: [str]` in the load request; names and aliases are unique
across the instances that hold a name (409 duplicate_model_name)."""
from __future__ import annotations

import pytest

from serving.models import InstanceState, ModelInstance
from tests.conftest import bearer

pytestmark = pytest.mark.django_db


def _load(client, operator, tiny_gguf, name, aliases):
    body = {"model_path": str(tiny_gguf), "model_name": name, "aliases": aliases}
    return client.post("/api/management/load", body, content_type="application/json", **bearer(operator.key))


def test_aliases_are_stored_and_unique_across_instances(client, node, operator, tiny_gguf):
    r = _load(client, operator, tiny_gguf, "main", ["gpt-4o", "main", "gpt-4o", "fast"])
    assert r.status_code == 202, r.content
    assert ModelInstance.objects.get(pk=r.json()["id"]).aliases == ["gpt-4o", "fast"]  # own name and repeats dropped
    for name, aliases in (("other", ["fast"]), ("gpt-4o", []), ("other", ["main"])):
        r = _load(client, operator, tiny_gguf, name, aliases)
        assert r.status_code == 409 and r.json()["error"]["code"] == "duplicate_model_name", (name, aliases, r.content)
    r = _load(client, operator, tiny_gguf, "other", ["bad alias!"])
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    ModelInstance.objects.filter(model_name="main").update(state=InstanceState.ERROR)  # no longer holds its names
    assert _load(client, operator, tiny_gguf, "other", ["fast"]).status_code == 202
