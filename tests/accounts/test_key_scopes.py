"""Key scopes (issue 34 #20): inference, read, manage. A key may do what its user's role allows
within its scopes: inference-only keys call models and read nothing of the console, read-only keys
read and never change, manage-only keys change and never read; keys made before scopes have all
three. A key with allowed_models reads /metrics, /api/requests and /api/usage rows of its models
only, and no other user's client addresses."""
from __future__ import annotations

import json

import pytest
from django.core.management import call_command
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from accounts.models import ApiKey
from accounts.services import create_api_key
from tests.asgi_calls import call_proxy
from tests.conftest import bearer


async def _proxy(key: str, path: str, method: str = "GET") -> tuple[int, bytes]:
    return await call_proxy(method, path, key)


def _key(user, *scopes: str, **limits) -> str:
    return create_api_key(user=user, name="-".join(scopes) or "all", scopes=list(scopes), **limits)[1]


@pytest.mark.django_db
def test_a_key_without_scopes_has_all_three_as_before(client, admin, viewer):
    assert ApiKey.objects.get(name=f"{viewer.user.username}-key").scopes == ["inference", "read", "manage"]
    r = client.post("/api/keys", data=json.dumps({"name": "client", "username": viewer.user.username,
                                                  "scopes": ["inference"]}),
                    content_type="application/json", **bearer(admin.key))
    assert r.status_code == 201 and r.json()["scopes"] == ["inference"]
    for bad in ([], ["admin"], "inference"):
        r = client.post("/api/keys", data=json.dumps({"name": "x", "username": viewer.user.username, "scopes": bad}),
                        content_type="application/json", **bearer(admin.key))
        assert r.status_code == 400, (bad, r.content)
    kid = ApiKey.objects.get(name="client").pk
    r = client.patch(f"/api/keys/{kid}", data=json.dumps({"scopes": ["read", "inference"]}),
                     content_type="application/json", **bearer(admin.key))
    assert r.status_code == 200 and r.json()["scopes"] == ["inference", "read"]
    call_command("createapikey", "--username", viewer.user.username, "--name", "cli-inf", "--scopes", "inference")
    assert ApiKey.objects.get(name="cli-inf").scopes == ["inference"]


@pytest.mark.django_db
def test_the_keys_page_takes_and_shows_scopes(admin, viewer):
    page = Client()
    page.force_login(admin.user)
    r = page.post("/keys/", {"name": "inf-only", "user": viewer.user.pk, "scopes": ["inference"], "priority": 4})
    assert r.status_code == 302, r.content[:500]
    key = ApiKey.objects.get(name="inf-only")
    assert key.scopes == ["inference"]
    listing = page.get("/keys/").content.decode()
    assert "<th>Scopes</th>" in listing and "inference, read, manage" in listing
    r = page.post(f"/keys/{key.pk}/", {"name": "inf-only", "scopes": ["inference", "read"], "priority": 4})
    assert r.status_code == 302
    key.refresh_from_db()
    assert key.scopes == ["inference", "read"]


@pytest.mark.django_db
def test_scopes_hold_on_the_console_api(client, operator):
    inference, read, manage = (_key(operator.user, s) for s in ("inference", "read", "manage"))
    for key, get_ok, write_ok in ((inference, False, False), (read, True, False), (manage, False, True)):
        r = client.get("/api/management/instances", **bearer(key))
        assert (r.status_code == 200) == get_ok, r.content
        if not get_ok:
            assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
        r = client.post("/api/management/unload", data=json.dumps({"id": 999999}), content_type="application/json",
                        **bearer(key))
        if write_ok:
            assert r.status_code not in (401, 403), r.content
        else:
            assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"


@pytest.mark.django_db(transaction=True)
async def test_scopes_hold_on_the_proxy(viewer):
    from asgiref.sync import sync_to_async

    inference, read, manage = [await sync_to_async(_key)(viewer.user, s) for s in ("inference", "read", "manage")]
    assert (await _proxy(inference, "/v1/models"))[0] == 200
    for key in (read, manage):
        status, body = await _proxy(key, "/v1/models")
        assert status == 403 and json.loads(body)["error"]["code"] == "insufficient_scope"
        assert (await _proxy(key, "/v1/chat/completions", "POST"))[0] == 403
    assert (await _proxy(read, "/metrics"))[0] == 200  # /metrics is a read
    assert (await _proxy(inference, "/metrics"))[0] == 403


@pytest.fixture
def two_tenants(db, admin, viewer):
    from hardware.models import Node
    from serving.models import ModelInstance, RequestLog, UsageBucket

    node = Node.objects.create(name="n1", address="127.0.0.1", last_heartbeat=timezone.now())
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    for model, user, client in (("ours", viewer.user.username, "10.0.0.1"), ("ours", "other-team", "10.9.9.9"),
                                ("theirs", "other-team", "10.9.9.8")):
        RequestLog.objects.create(at=timezone.now(), request_id=f"r-{model}-{user}", key_id=1, key_name="k",
                                  username=user, model=model, status=200, client=client)
        UsageBucket.objects.create(bucket_start=hour, key_id=1, key_name="k", username=user, model=model, requests=1)
        ModelInstance.objects.get_or_create(model_name=model, defaults={"model_path": "/m", "node": node,
                                                                        "state": "READY", "gpus": [0]})
    return _key(viewer.user, "inference", "read", allowed_models=["ours"])


@pytest.mark.django_db
def test_a_key_with_allowed_models_reads_its_models_rows_only(client, admin, viewer, two_tenants):
    rows = client.get("/api/requests", **bearer(two_tenants)).json()["items"]
    assert sorted((r["model"], r["user"], r["client"]) for r in rows) == [
        ("ours", "other-team", ""), ("ours", viewer.user.username, "10.0.0.1")]
    usage = client.get("/api/usage", {"group_by": "model"}, **bearer(two_tenants)).json()["items"]
    assert {r["model"] for r in usage} == {"ours"}
    refused = client.get("/api/usage/chargeback", **bearer(two_tenants))  # every tenant's split: not for it
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_limited_key"
    assert client.get("/api/usage/chargeback", **bearer(admin.key)).status_code == 200
    everything = client.get("/api/requests", **bearer(admin.key)).json()["items"]  # a key without: all rows
    assert {r["model"] for r in everything} == {"ours", "theirs"} and "10.9.9.8" in {r["client"] for r in everything}


@pytest.mark.django_db
def test_a_key_with_allowed_models_lists_its_models_instances_only(client, admin, two_tenants):
    from serving.models import ModelInstance

    listed = client.get("/api/management/instances", **bearer(two_tenants)).json()
    assert {i["model_name"] for i in listed} == {"ours"}
    theirs = ModelInstance.objects.get(model_name="theirs").pk
    assert client.get(f"/api/management/instances/{theirs}", **bearer(two_tenants)).status_code == 404
    assert client.get(f"/api/management/instances/{theirs}", **bearer(admin.key)).status_code == 200
    assert {i["model_name"] for i in client.get("/api/management/instances", **bearer(admin.key)).json()} == {
        "ours", "theirs"}


@pytest.mark.django_db(transaction=True)
async def test_a_key_with_allowed_models_reads_metrics_of_its_models_only(admin, two_tenants):
    from asgiref.sync import sync_to_async

    from serving.proxy import metrics

    metrics.REQUESTS.labels(model="theirs", instance="1", status="200").inc()
    metrics.REQUESTS.labels(model="ours", instance="2", status="200").inc()
    status, body = await _proxy(two_tenants, "/metrics")
    assert status == 200
    models = {s.labels["model"] for f in text_string_to_metric_families(body.decode()) for s in f.samples
              if "model" in s.labels}
    assert models == {"ours"}
    admin_key = await sync_to_async(lambda: admin.key)()
    everything = (await _proxy(admin_key, "/metrics"))[1].decode()
    assert 'model="theirs"' in everything


def test_the_metrics_filter_reads_escaped_label_values():
    from serving.proxy.metrics import only_models

    text = (b'# HELP x h\n# TYPE x counter\nx_total{instance="1",model="a\\"b"} 1.0\n'
            b'x_total{model="c",instance="2"} 2.0\nup 1.0\n')
    assert only_models(text, frozenset({'a"b'})) == b'# HELP x h\n# TYPE x counter\nx_total{instance="1",model="a\\"b"} 1.0\nup 1.0\n'


@pytest.mark.django_db
def test_a_key_gives_no_key_more_scopes_than_it_holds(client, admin, viewer):
    manage_only = _key(admin.user, "manage")

    def create(scopes):
        body = {"name": "made", "username": viewer.user.username, **({"scopes": scopes} if scopes else {})}
        return client.post("/api/keys", data=json.dumps(body), content_type="application/json",
                           **bearer(manage_only))

    for scopes in (None, ["inference"], ["manage", "read"]):  # absent means all three
        r = create(scopes)
        assert r.status_code == 403 and r.json()["error"]["code"] == "scope_escalation", (scopes, r.content)
    made = create(["manage"])
    assert made.status_code == 201
    r = client.patch(f"/api/keys/{made.json()['id']}", data=json.dumps({"scopes": ["manage", "inference"]}),
                     content_type="application/json", **bearer(manage_only))
    assert r.status_code == 403 and r.json()["error"]["code"] == "scope_escalation"
    assert client.patch(f"/api/keys/{made.json()['id']}", data=json.dumps({"scopes": ["inference"]}),
                        content_type="application/json", **bearer(admin.key)).status_code == 200
    own = ApiKey.objects.get(name=f"{admin.user.username}-key").pk  # nor its own, which would shut it out
    r = client.patch(f"/api/keys/{own}", data=json.dumps({"scopes": ["read"]}), content_type="application/json",
                     **bearer(admin.key))
    assert r.status_code == 403 and r.json()["error"]["code"] == "own_scopes"
    assert ApiKey.objects.get(pk=own).scopes == ["inference", "read", "manage"]
