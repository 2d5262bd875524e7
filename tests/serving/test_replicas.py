"""Replicas of one served name through the management API (issue 30 #1, #3): a load of N, spread
over GPUs and nodes as the plan places them, a count that does not fit (409 with the numbers, and
nothing recorded; or `partial`), scale up and down (the replica with the fewest requests in flight
leaves routing at once), unload of all, and eviction that counts every replica. The agents' side
(processes, ports, the drain) runs for real in tests/faults/test_replicas.py."""
from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
from django.utils import timezone

from tests.conftest import bearer
from tests.serving.conftest import LLAMA_CPP_PYTHON, NODE

pytestmark = pytest.mark.django_db
LLAMA_SERVER_CUDA = {"name": "llama-server", "available": True, "version": "b6500", "flavour": "cuda",
                     "path": "/opt/llama-server", "reason": ""}


def post(client, path, body, key):
    return client.post(f"/api/management/{path}", body, content_type="application/json", **bearer(key))


def err(r, status):
    assert r.status_code == status, (r.status_code, r.content[:600])
    body = r.json()
    assert set(body["error"]) == {"message", "type", "code"}
    return body["error"]


def _gpu_node(name: str, gpus: list[int]):
    """A node with llama-server (CUDA) and GPUs of `gpus` MiB each, nothing used."""
    from hardware.models import GpuDevice
    from hardware.services import register_node

    node = register_node(name=name, address="127.0.0.1")
    node.backends = [LLAMA_SERVER_CUDA, LLAMA_CPP_PYTHON]
    node.detector = "nvml"
    node.save()
    for index, total in enumerate(gpus):
        GpuDevice.objects.create(node=node, index=index, vendor="NVIDIA", type="NVIDIA", name="L4",
                                 memory_total_mib=total, memory_used_mib=0)
    return node


def _ready(pk: int, *, port: int, gpus: list[int] | None = None) -> None:
    """Walk the instance to READY as its node agent would."""
    from serving.models import ModelInstance

    inst = ModelInstance.objects.get(pk=pk)
    inst.mark_loading(pid=0, pgid=0, port=port, gpus=gpus if gpus is not None else list(inst.gpus), message="start")
    inst.mark_warming()
    inst.mark_ready("ready")


def _counts():
    from serving.models import InstanceEvent, ModelDeployment, ModelInstance

    return ModelInstance.objects.count(), InstanceEvent.objects.count(), ModelDeployment.objects.count()


def test_a_load_of_three_on_one_cpu_node_makes_three_replicas_and_one_desired_count(client, node, operator,
                                                                                      tiny_gguf):
    from serving.models import ModelDeployment, ModelInstance

    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "tiny", "replicas": 3}, operator.key)
    assert r.status_code == 202, r.content
    body = r.json()
    assert body["replicas_wanted"] == 3 and body["partial"] is False and body["refused"] == []
    assert [(x["replica"], x["node"], x["gpus"], x["state"]) for x in body["replicas"]] == [
        (0, NODE, [], "PENDING"), (1, NODE, [], "PENDING"), (2, NODE, [], "PENDING")]
    rows = list(ModelInstance.objects.filter(model_name="tiny").order_by("replica"))
    assert [i.replica for i in rows] == [0, 1, 2]
    assert all(i.plan and i.plan["argv"] and i.estimated_memory_mib == rows[0].estimated_memory_mib for i in rows)
    assert "replica 1 of tiny requested" in rows[1].events.first().message
    assert ModelDeployment.objects.get(model_name="tiny").replicas == 3
    listed = client.get("/api/management/instances", **bearer(operator.key)).json()
    assert sorted((i["replica"], i["replicas_desired"]) for i in listed) == [(0, 3), (1, 3), (2, 3)]
    # Unload stops all of them; the desired count is 0.
    r = post(client, "unload", {"model_name": "tiny"}, operator.key)
    assert r.status_code == 202, r.content
    assert set(ModelInstance.objects.filter(model_name="tiny").values_list("desired_state", flat=True)) == {"STOPPED"}
    assert ModelDeployment.objects.get(model_name="tiny").replicas == 0


def test_replicas_spread_over_gpus_then_nodes_and_never_share_a_gpu(client, operator, serving_settings, tiny_gguf):
    _gpu_node("gpu-a", [8000, 8000])
    _gpu_node("gpu-b", [8000])
    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "spread", "node": "gpu-a",
                              "replicas": 1}, operator.key)
    assert r.status_code == 202, r.content
    first = r.json()
    r = post(client, "scale", {"model_name": "spread", "replicas": 3}, operator.key)
    assert r.status_code == 202, r.content
    body = r.json()
    assert (body["previous"], body["replicas"], body["partial"]) == (1, 3, False)
    places = {(x["node"], tuple(x["gpus"])) for x in body["instances"]}
    assert len(places) == 3, "no GPU holds two replicas"
    a_gpus = {g for x in body["instances"] if x["node"] == "gpu-a" for g in x["gpus"]}
    assert a_gpus == {0, 1}, "the other GPU of the node first"
    assert ("gpu-b", (0,)) in places, "then the other node"
    assert first["node"] == "gpu-a"
    # A fourth has no GPU left that holds no replica: 409 with the numbers, nothing recorded.
    before = _counts()
    e = err(post(client, "scale", {"model_name": "spread", "replicas": 4}, operator.key), 409)
    assert e["code"] == "does_not_fit" and "4 replicas of spread do not fit: 3 fit" in e["message"], e
    assert "holds a replica of spread already" in e["message"]
    assert _counts() == before


def test_a_count_that_does_not_fit_is_refused_whole_or_started_in_part(client, node, operator, tiny_gguf):
    from serving.models import ModelDeployment, ModelInstance

    type(node).objects.filter(pk=node.pk).update(model_memory_mib=1100)  # room for two of 514 MiB
    before = _counts()
    e = err(post(client, "load", {"model_path": str(tiny_gguf), "model_name": "big", "replicas": 3},
                 operator.key), 409)
    assert e["code"] == "does_not_fit" and "3 replicas of big do not fit: 2 fit" in e["message"], e
    assert '"fit": 2' in e["message"] and "node-t" in e["message"], "the numbers: how many fit, where"
    assert _counts() == before, "nothing half-planned: no instance, no timeline row, no desired count"
    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "big", "replicas": 3, "partial": True},
             operator.key)
    assert r.status_code == 202, r.content
    body = r.json()
    assert body["partial"] is True and len(body["replicas"]) == 2 and body["replicas_wanted"] == 3
    assert "1100 MiB offered" in body["refused"][0]
    assert ModelInstance.objects.filter(model_name="big").count() == 2
    assert ModelDeployment.objects.get(model_name="big").replicas == 2
    # Scaling up past what fits: 409 again, and nothing changes.
    before = _counts()
    e = err(post(client, "scale", {"model_name": "big", "replicas": 3}, operator.key), 409)
    assert e["code"] == "does_not_fit" and '"running": 2' in e["message"]
    assert _counts() == before and ModelDeployment.objects.get(model_name="big").replicas == 2


def test_scale_down_takes_the_replica_with_the_fewest_in_flight_out_of_routing_at_once(client, node, operator,
                                                                                        tiny_gguf):
    from serving.models import InFlightReport, ModelDeployment, ModelInstance
    from serving.proxy.replicas import _read_rows

    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "busy", "replicas": 3}, operator.key)
    assert r.status_code == 202, r.content
    ids = [x["id"] for x in r.json()["replicas"]]
    for n, pk in enumerate(ids):
        _ready(pk, port=28100 + n)
    # Replica 1 answers requests (as a web process reports them); 0 and 2 are idle.
    InFlightReport.objects.create(process="web-a:1", model_name="busy", in_flight=2, instances={str(ids[1]): 2})
    r = post(client, "scale", {"model_name": "busy", "replicas": 1, "drain_timeout_s": 12}, operator.key)
    assert r.status_code == 202, r.content
    body = r.json()
    assert (body["previous"], body["replicas"]) == (3, 1) and len(body["draining"]) == 2
    assert set(body["draining"]) == {ids[0], ids[2]}, "the one with requests in flight stays"
    rows, _, _ = _read_rows()
    routed = {row["pk"] for row in rows if row["model_name"] == "busy"}
    assert routed == {i for i in ids if i not in body["draining"]}, "drained replicas leave routing at once"
    for pk in body["draining"]:
        inst = ModelInstance.objects.get(pk=pk)
        assert inst.state == "UNLOADING" and inst.desired_state == "STOPPED"
        assert 0 < (inst.drain_until - timezone.now()).total_seconds() <= 12
        assert "scaled down from 3 to 1 replicas" in inst.state_message
    assert ModelDeployment.objects.get(model_name="busy").replicas == 1
    # The numbers left: up again takes the lowest free replica numbers once the drained ones stop.
    for pk in body["draining"]:
        ModelInstance.objects.get(pk=pk).mark_stopped("drained")
    r = post(client, "scale", {"model_name": "busy", "replicas": 2}, operator.key)
    assert r.status_code == 202, r.content
    assert sorted(x["replica"] for x in r.json()["instances"]) == sorted(
        [ModelInstance.objects.get(pk=i).replica for i in ids if i not in body["draining"]]
        + [min({0, 1, 2} - {ModelInstance.objects.get(pk=i).replica for i in ids if i not in body["draining"]})])


def test_scale_refuses_what_it_cannot_do(client, node, operator, viewer, tiny_gguf):
    for bad in (0, 17, -1, "two", None):
        e = err(post(client, "scale", {"model_name": "x", "replicas": bad}, operator.key), 400)
        assert e["message"]
    e = err(post(client, "scale", {"model_name": "nothing-loaded", "replicas": 2}, operator.key), 404)
    assert e["code"] == "model_not_found"
    err(post(client, "scale", {"model_name": "x", "replicas": 2}, viewer.key), 403)
    assert client.post("/api/management/scale", {}, content_type="application/json").status_code == 401
    for bad in (0, 17):
        err(post(client, "load", {"model_path": str(tiny_gguf), "replicas": bad}, operator.key), 400)
    e = err(post(client, "load", {"model_path": str(tiny_gguf), "replicas": 2, "gpus": [0]}, operator.key), 400)
    assert "gpus places one replica" in e["message"]


def test_eviction_counts_every_replica_and_spares_the_busy_and_the_pinned(client, node, operator, tiny_gguf):
    """Issue 30 #3: three replicas of an on_demand model fill a capped node; a click evicts the
    least recently used replicas it needs, never one with requests in flight, never a pinned one."""
    from serving.models import InFlightReport, ModelInstance

    type(node).objects.filter(pk=node.pk).update(model_memory_mib=1600)  # room for three of 514 MiB
    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "od", "policy": "on_demand",
                              "start": True, "replicas": 3}, operator.key)
    assert r.status_code == 202, r.content
    ids = [x["id"] for x in r.json()["replicas"]]
    for n, pk in enumerate(ids):
        _ready(pk, port=28200 + n)
    long_ago = timezone.now() - timedelta(minutes=10)
    ModelInstance.objects.filter(pk__in=ids).update(last_request_at=long_ago)
    # Replica 0 has requests in flight (as a web process reports them), used long ago or not.
    report = InFlightReport.objects.create(process="web-a:1", model_name="od", in_flight=1,
                                           instances={str(ids[0]): 1})
    # Every replica counts: the node is full, so a click evicts one, not the busy one.
    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "clicked"}, operator.key)
    assert r.status_code == 202, r.content
    desired = dict(ModelInstance.objects.filter(pk__in=ids).values_list("pk", "desired_state"))
    assert desired[ids[0]] == "RUNNING", "a replica with requests in flight is never evicted"
    assert sorted(desired.values()) == ["IDLE", "RUNNING", "RUNNING"]
    post(client, "unload", {"model_name": "clicked"}, operator.key)
    # Pinned: none of its replicas goes, and the refusal says why.
    ModelInstance.objects.filter(pk__in=ids).update(desired_state="RUNNING", pinned=True)
    e = err(post(client, "load", {"model_path": str(tiny_gguf), "model_name": "clicked2"}, operator.key), 409)
    assert e["code"] == "does_not_fit" and "pinned or always" in e["message"], e
    ModelInstance.objects.filter(pk__in=ids).update(pinned=False)
    InFlightReport.objects.filter(pk=report.pk).update(instances={str(pk): 1 for pk in ids})
    e = err(post(client, "load", {"model_path": str(tiny_gguf), "model_name": "clicked3"}, operator.key), 409)
    assert "(requests in flight)" in e["message"], e


@pytest.mark.django_db(transaction=True)  # the table reads in its own thread
def test_v1_models_lists_each_replica_with_its_node_gpus_and_state(client, node, operator, tiny_gguf):
    import asyncio

    from serving.proxy.replicas import RoutingTable
    from serving.proxy.routing import _model_entry

    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "listed", "replicas": 2}, operator.key)
    ids = [x["id"] for x in r.json()["replicas"]]
    for n, pk in enumerate(ids):
        _ready(pk, port=28300 + n)
    table = RoutingTable(listen=False)
    snap = asyncio.run(table.refresh())
    entry = _model_entry(snap.by_name["listed"])
    assert entry["replicas"] == 2
    assert [(i["replica"], i["node"], i["gpus"], i["state"]) for i in entry["instances"]] == [
        (0, NODE, [], "READY"), (1, NODE, [], "READY")]


def test_the_pages_show_replicas_and_an_operator_scales_from_them(client, node, operator, viewer, tiny_gguf):
    """The instances list and the instance page: each replica with its node, GPUs and state, the
    desired count, and the scale control (number + button, htmx) that only operators may use."""
    from django.test import Client

    from accounts.models import AuditEvent
    from serving.models import ModelInstance

    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "paged", "replicas": 2}, operator.key)
    ids = [x["id"] for x in r.json()["replicas"]]
    op, view = Client(), Client()
    op.force_login(operator.user)
    view.force_login(viewer.user)
    listing = op.get("/instances/").content.decode()
    assert f'id="inst-replica-{ids[1]}"' in listing and "replica 1 of 2" in listing
    assert f'id="scale-form-{ids[0]}"' in listing and 'name="replicas"' in listing
    page = op.get(f"/instances/{ids[0]}/").content.decode()
    assert "Replicas of paged: 2 running, 2 wanted" in page
    for pk in ids:
        assert f'id="replica-{pk}"' in page
    assert f'hx-post="/instances/{ids[0]}/scale"' in page and 'value="2"' in page
    assert "scale-form" not in view.get(f"/instances/{ids[0]}/").content.decode()
    # A viewer is refused by the server, whatever the page shows.
    assert view.post(f"/instances/{ids[0]}/scale", {"replicas": "3"}, HTTP_HX_REQUEST="true").status_code == 403
    r = op.post(f"/instances/{ids[0]}/scale", {"replicas": "3"}, HTTP_HX_REQUEST="true")
    assert r.status_code == 200 and "paged: 2 -&gt; 3 replicas requested" in r.content.decode(), r.content
    assert ModelInstance.objects.filter(model_name="paged", desired_state="RUNNING").count() == 3
    r = op.post(f"/instances/{ids[0]}/scale", {"replicas": "99"}, HTTP_HX_REQUEST="true")
    assert "replicas must be 1..16" in r.content.decode()
    assert list(AuditEvent.objects.filter(action="scale").values_list("outcome", flat=True).order_by("pk")) == [
        "success", "refused"]


def test_usage_is_kept_per_replica_and_summed_per_model(client, node, admin, tiny_gguf):
    """Usage buckets and the request log carry the replica's instance; group_by=model sums them."""
    from serving.models import RequestLog, UsageBucket

    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "summed", "replicas": 2}, admin.key)
    ids = [x["id"] for x in r.json()["replicas"]]
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    for pk, n in zip(ids, (3, 5), strict=True):
        UsageBucket.objects.create(bucket_start=hour, model="summed", instance_id=pk, node=NODE, requests=n,
                                   prompt_tokens=10 * n, completion_tokens=n)
        for _ in range(n):
            RequestLog.objects.create(at=timezone.now(), request_id=f"r-{pk}-{_}", model="summed", instance_id=pk,
                                      node=NODE, status=200)
    rows = client.get("/api/usage", {"group_by": "model", "from": (hour - timedelta(hours=1)).isoformat()},
                      **bearer(admin.key)).json()["items"]
    assert [(x["model"], x["requests"], x["prompt_tokens"]) for x in rows] == [("summed", 8, 80)]
    log = client.get("/api/requests", {"model": "summed"}, **bearer(admin.key)).json()["items"]
    assert sorted(Counter(x["instance_id"] for x in log).items()) == [(ids[0], 3), (ids[1], 5)]


def test_a_rollout_checks_every_replica_first_and_goes_one_at_a_time(client, node, operator, viewer, tiny_gguf):
    from serving.control.rollout import progress_rollouts
    from serving.models import ModelDeployment, ModelInstance

    r = post(client, "load", {"model_path": str(tiny_gguf), "model_name": "rolled", "replicas": 2}, operator.key)
    ids = [x["id"] for x in r.json()["replicas"]]
    for n, pk in enumerate(ids):
        _ready(pk, port=28400 + n)
    e = err(post(client, "rollout", {"model_name": "rolled", "extra_args": {"--rm": "-rf"}}, operator.key), 400)
    assert e["code"] == "invalid_extra_args"
    assert ModelDeployment.objects.get(model_name="rolled").rollout is None, "nothing changes"
    err(post(client, "rollout", {"model_name": "rolled"}, viewer.key), 403)
    err(post(client, "rollout", {"model_name": "nothing"}, operator.key), 404)
    r = post(client, "rollout", {"model_name": "rolled", "extra_args": {"--n_ctx": 1024}}, operator.key)
    assert r.status_code == 202 and r.json()["order"] == ids, r.content
    e = err(post(client, "rollout", {"model_name": "rolled"}, operator.key), 409)
    assert e["code"] == "rollout_in_progress"
    assert progress_rollouts() == [ids[0]]
    first = ModelInstance.objects.get(pk=ids[0])
    assert first.state == "UNLOADING" and first.restart_requested and first.extra_args == {"--n_ctx": 1024}
    assert "1024" in " ".join(first.plan["argv"]) and first.drain_until is not None
    assert progress_rollouts() == [], "the next waits while the first is not READY again"
    first.mark_stopped("restarting", keep_gpus=True)
    ModelInstance.objects.filter(pk=ids[0]).update(restart_requested=False)
    first.mark_pending("restarting")
    _ready(ids[0], port=28410)
    assert progress_rollouts() == [ids[1]]
    assert progress_rollouts() == []
    ModelInstance.objects.filter(pk=ids[1]).update(restart_requested=False)
    second = ModelInstance.objects.get(pk=ids[1])
    second.mark_stopped("restarting", keep_gpus=True)
    second.mark_pending("restarting")
    _ready(ids[1], port=28411)
    assert progress_rollouts() == [] and ModelDeployment.objects.get(model_name="rolled").rollout is None
