"""A node's cache on real files, against both stores: what it holds, Verify, Evict (never of a
model in use), the XGEN_CACHE_MAX_GB budget, and delete-from-store following into the caches."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
from django.test import Client
from django.utils import timezone

from hub import node_cache, writes
from hub.cache import CacheFull, cache_dir_for, last_sync_stats, sync_to_cache
from hub.models import CacheEntry, CacheJob
from tests.conftest import bearer
from tests.hub.conftest import make_model_dir

pytestmark = pytest.mark.django_db(transaction=True)

NODE = "cache-node"


@pytest.fixture
def node(hub_dirs):
    from hardware.models import Node

    return Node.objects.create(name=NODE, address="127.0.0.1", last_heartbeat=timezone.now())


@pytest.fixture
def users() -> Iterator[dict[str, list]]:
    """The instances that use a prefix on NODE, as serving would report them (a test fills it)."""
    from serving.control.allocation import cache_users

    in_use: dict[str, list] = {}
    node_cache.set_users_source(lambda name: in_use if name == NODE else {})
    yield in_use
    node_cache.set_users_source(cache_users)


def _put(store, tmp_path, prefix: str, size: int) -> dict[str, bytes]:
    files = {"model.gguf": os.urandom(size)}
    store.upload_model(prefix, make_model_dir(tmp_path / prefix.replace("/", "_"), files))
    return files


def _agent_runs_jobs(store) -> list[CacheJob]:
    """What the node's HubWorker does each pass: claim this node's cache jobs and run them."""
    done = []
    while (job := node_cache.claim_next_cache_job(node_name=NODE)) is not None:
        done.append(node_cache.run_cache_job(job.pk, store=store))
    return done


def _post(client: Client, url: str, body: dict, key: str):
    return client.post(url, data=json.dumps(body), content_type="application/json", **bearer(key))


def test_the_api_shows_disk_and_each_cached_model_with_its_user(store, node, users, tmp_path, viewer):
    _put(store, tmp_path, "gguf/a", 300_000)
    _put(store, tmp_path, "gguf/b", 200_000)
    for prefix in ("gguf/a", "gguf/b"):
        sync_to_cache(prefix, node_name=NODE, store=store)
    users["gguf/a"] = [node_cache.CacheUser(id=7, model_name="chat-a", state="READY")]
    node_cache.report_disk(node_name=NODE)

    body = Client().get(f"/api/hardware/nodes/{NODE}/cache", **bearer(viewer.key)).json()
    assert body["node"] == NODE and body["free_bytes"] > 0 and body["total_bytes"] >= body["free_bytes"]
    assert body["used_bytes"] >= 500_000 + 2 * 100  # the files and each local manifest
    models = {m["prefix"]: m for m in body["models"]}
    assert set(models) == {"gguf/a", "gguf/b"}
    assert models["gguf/a"]["size_bytes"] == 300_000 and models["gguf/a"]["last_used_at"]
    assert models["gguf/a"]["used_by"] == [{"id": 7, "model_name": "chat-a", "state": "READY"}]
    assert models["gguf/b"]["used_by"] == [] and models["gguf/b"]["verified"] is False
    assert Client().get("/api/hardware/nodes/nope/cache", **bearer(viewer.key)).status_code == 404


def test_verify_rechecks_sizes_and_hashes_and_shows_what_differs(store, node, users, tmp_path, operator, viewer):
    files = _put(store, tmp_path, "gguf/v", 100_000)
    local = sync_to_cache("gguf/v", node_name=NODE, store=store)
    client = Client()
    r = _post(client, f"/api/hardware/nodes/{NODE}/cache/verify", {"prefix": "gguf/v"}, operator.key)
    assert r.status_code == 202, r.content
    assert r.json()["status"] == "PENDING"
    [job] = _agent_runs_jobs(store)
    assert job.status == "COMPLETED" and job.result == {"ok": True, "problems": []}
    assert client.get(f"/api/hardware/nodes/{NODE}/cache", **bearer(viewer.key)).json()["models"][0]["verified"]

    flipped = bytearray(files["model.gguf"])
    flipped[10] ^= 0xFF  # same size, other bytes: only the hash can tell
    (local / "model.gguf").write_bytes(bytes(flipped))
    (local / "stray.bin").write_bytes(b"x")
    _post(client, f"/api/hardware/nodes/{NODE}/cache/verify", {"prefix": "gguf/v"}, operator.key)
    [job] = _agent_runs_jobs(store)
    assert job.result["ok"] is False
    assert job.result["problems"] == ["model.gguf: sha256 differs from the manifest", "stray.bin: not in the manifest"]
    got = client.get(f"/api/hardware/nodes/{NODE}/cache/jobs/{job.pk}", **bearer(viewer.key)).json()
    assert got["result"]["problems"] == job.result["problems"]
    model = client.get(f"/api/hardware/nodes/{NODE}/cache", **bearer(viewer.key)).json()["models"][0]
    assert model["verified"] is False and model["state"] == "FAILED" and "sha256 differs" in model["error"]
    # The next load re-fetches the bad file: the copy is whole again.
    sync_to_cache("gguf/v", node_name=NODE, store=store, verify=True)
    assert (local / "model.gguf").read_bytes() == files["model.gguf"]


def test_evict_is_refused_while_an_instance_uses_the_model(store, node, users, tmp_path, operator, viewer):
    _put(store, tmp_path, "gguf/e", 50_000)
    local = sync_to_cache("gguf/e", node_name=NODE, store=store)
    users["gguf/e"] = [node_cache.CacheUser(id=3, model_name="e", state="READY")]
    client = Client()
    url = f"/api/hardware/nodes/{NODE}/cache/evict"
    assert _post(client, url, {"prefix": "gguf/e"}, viewer.key).status_code == 403
    r = _post(client, url, {"prefix": "gguf/e"}, operator.key)
    assert r.status_code == 409 and "#3 e" in r.json()["error"]["message"]
    assert _post(client, url, {"prefix": "gguf/../x"}, operator.key).status_code == 400
    assert _post(client, url, {"prefix": "gguf/not-cached"}, operator.key).status_code == 404

    # The agent checks again: an instance that started after the request still keeps its files.
    users.clear()
    assert _post(client, url, {"prefix": "gguf/e"}, operator.key).status_code == 202
    users["gguf/e"] = [node_cache.CacheUser(id=4, model_name="e2", state="LOADING")]
    [job] = _agent_runs_jobs(store)
    assert job.status == "FAILED" and "#4 e2" in job.error and local.is_dir()
    model = client.get(f"/api/hardware/nodes/{NODE}/cache", **bearer(viewer.key)).json()["models"][0]
    assert model["last_job_error"].startswith("evict failed:") and "#4 e2" in model["last_job_error"]

    users.clear()
    _post(client, url, {"prefix": "gguf/e"}, operator.key)
    [job] = _agent_runs_jobs(store)
    assert job.status == "COMPLETED" and job.result["freed_bytes"] >= 50_000
    assert not local.exists() and not CacheEntry.objects.filter(prefix="gguf/e").exists()


def test_the_budget_evicts_unused_models_least_recently_used_first(store, node, users, tmp_path, settings, caplog):
    for name in ("old", "mid", "busy"):
        _put(store, tmp_path, f"gguf/{name}", 400_000)
        sync_to_cache(f"gguf/{name}", node_name=NODE, store=store)
    _put(store, tmp_path, "gguf/new", 400_000)
    now = timezone.now()
    for i, name in enumerate(("busy", "old", "mid")):  # busy is the least recent, but in use
        CacheEntry.objects.filter(prefix=f"gguf/{name}").update(last_used_at=now - timezone.timedelta(hours=3 - i))
    users["gguf/busy"] = [node_cache.CacheUser(id=1, model_name="busy", state="READY")]
    settings.CACHE_MAX_BYTES = 1_300_000  # three models fit, four do not

    sync_to_cache("gguf/new", node_name=NODE, store=store)
    assert last_sync_stats["gguf/new"].evicted == ["gguf/old"]
    assert "XGEN_CACHE_MAX_GB: evicted gguf/old" in caplog.text
    assert not cache_dir_for("gguf/old").exists()
    assert all(cache_dir_for(f"gguf/{n}").is_dir() for n in ("mid", "busy", "new"))

    # Only models in use left besides the one to fetch: refused, nothing evicted.
    users["gguf/mid"] = users["gguf/new"] = [node_cache.CacheUser(id=2, model_name="m", state="READY")]
    _put(store, tmp_path, "gguf/big", 400_000)
    with pytest.raises(CacheFull, match="XGEN_CACHE_MAX_GB"):
        sync_to_cache("gguf/big", node_name=NODE, store=store)
    assert all(cache_dir_for(f"gguf/{n}").is_dir() for n in ("mid", "busy", "new"))


def test_deleting_from_the_store_evicts_every_unused_copy(store, node, users, tmp_path):
    from hardware.models import Node

    other = Node.objects.create(name="other-node", address="127.0.0.2")
    _put(store, tmp_path, "gguf/gone", 10_000)
    local = sync_to_cache("gguf/gone", node_name=NODE, store=store)
    CacheEntry.objects.create(node=other, prefix="gguf/gone", state="READY")
    node_cache.set_users_source(lambda name: {"gguf/gone": [node_cache.CacheUser(1, "g", "READY")]}
                                if name == "other-node" else {})
    writes.delete_model(prefix="gguf/gone", store=store)
    assert list(CacheJob.objects.values_list("node", "action")) == [(NODE, "evict")]
    _agent_runs_jobs(store)
    assert not local.exists()
    assert list(CacheEntry.objects.values_list("node__name", flat=True)) == ["other-node"]  # in use there: kept


def test_serving_reports_which_instances_use_a_prefix(node):
    from serving.control.allocation import cache_users
    from serving.models import ModelInstance

    ModelInstance.objects.create(model_name="r", model_path="gguf/x", node=node, state="READY")
    ModelInstance.objects.create(model_name="s", model_path="gguf/y", node=node, state="STOPPED")
    ModelInstance.objects.create(model_name="p", model_path="/abs/model.gguf", node=node, state="READY")
    got = cache_users(NODE)
    assert list(got) == ["gguf/x"] and got["gguf/x"][0].model_name == "r"


# --------------------------------------------------------------------------- cache jobs as jobs
def test_a_cache_job_is_cancelled_and_shown_as_the_other_jobs_are(store, node, users, tmp_path, operator, viewer):
    """Issue 24 #4: an Evict or a Verify has the lifecycle of a download or an upload: cancel
    (`hub.jobs.request_cancel`, from its row's button or the API) and its row (`_job_row.html`)."""
    _put(store, tmp_path, "gguf/c", 20_000)
    sync_to_cache("gguf/c", node_name=NODE, store=store)
    api = Client()
    job_id = _post(api, f"/api/hardware/nodes/{NODE}/cache/verify", {"prefix": "gguf/c"}, operator.key).json()["id"]
    cancel = f"/api/hardware/nodes/{NODE}/cache/jobs/{job_id}/cancel"
    assert api.post(cancel, **bearer(viewer.key)).status_code == 403
    assert api.post(f"/api/hardware/nodes/{NODE}/cache/jobs/999999/cancel", **bearer(operator.key)).status_code == 404
    r = api.post(cancel, **bearer(operator.key))
    assert r.status_code == 200, r.content
    assert r.json()["status"] == "CANCELLED" and r.json()["error"] == "Cancelled before it started."
    assert _agent_runs_jobs(store) == []  # no agent claims it

    # The card lists the node's jobs with the one row template; an active one has its Cancel button.
    page = Client()
    page.force_login(operator.user)
    page.post(f"/nodes/{NODE}/cache/evict/", {"prefix": "gguf/c"})
    evict = CacheJob.objects.get(action="evict")
    html = page.get(f"/nodes/{NODE}/cache/").content.decode()
    assert f'id="cache-job-{job_id}"' in html and f'id="cache-job-{evict.number}"' in html
    assert 'data-status="CANCELLED"' in html and 'data-status="PENDING"' in html
    cancel_url = f"/nodes/{NODE}/cache/jobs/{evict.number}/cancel/"
    assert cancel_url in html and f"/nodes/{NODE}/cache/jobs/{job_id}/cancel/" not in html
    assert page.post(cancel_url).status_code == 302
    evict.refresh_from_db()
    assert evict.status == "CANCELLED" and cache_dir_for("gguf/c").is_dir()  # nothing evicted
    watcher = Client()
    watcher.force_login(viewer.user)
    assert watcher.post(cancel_url).status_code == 403


def test_a_cancel_of_a_claimed_verify_stops_it_and_records_nothing(store, node, users, tmp_path):
    _put(store, tmp_path, "gguf/s", 30_000)
    sync_to_cache("gguf/s", node_name=NODE, store=store)
    node_cache.request_cache_job(node=node, prefix="gguf/s", action="verify")
    job = node_cache.claim_next_cache_job(node_name=NODE)
    assert job.status == "RUNNING"
    from hub.jobs import request_cancel

    assert request_cancel(job).cancel_requested  # a running job is asked; its agent ends it
    done = node_cache.run_cache_job(job.pk, store=store)
    assert done.status == "CANCELLED" and done.error == "Cancelled by a user." and done.result == {}
    assert CacheEntry.objects.get(prefix="gguf/s").verified_at is None

    # Verify stops between two files when told to (the job's step raises), recording nothing.
    local = cache_dir_for("gguf/s")
    (local / "model.gguf").write_bytes(b"other bytes")

    def stop(done: int, total: int) -> None:
        raise node_cache.CacheJobCancelled()

    with pytest.raises(node_cache.CacheJobCancelled):
        node_cache.verify("gguf/s", node_name=NODE, store=store, step=stop)
    entry = CacheEntry.objects.get(prefix="gguf/s")
    assert entry.verified_at is None and entry.state == "READY"


def test_a_verify_shows_its_progress_in_bytes(store, node, users, tmp_path):
    files = {"a.gguf": os.urandom(40_000), "b.bin": os.urandom(10_000)}
    store.upload_model("gguf/p", make_model_dir(tmp_path / "p", files))
    sync_to_cache("gguf/p", node_name=NODE, store=store)
    node_cache.request_cache_job(node=node, prefix="gguf/p", action="verify")
    [job] = _agent_runs_jobs(store)
    assert job.status == "COMPLETED" and job.result["ok"] is True
    assert job.bytes_total == 50_000 and job.percent == 100
