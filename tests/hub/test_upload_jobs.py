"""Uploads are jobs (issue 11): the request checks and queues, the node's agent claims and copies,
progress and cancel go through the database, and one writer at a time per model (issue 17 #5).
A failed or refused re-upload never leaves a broken model listed as complete (issue 17 #6)."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import pytest
from asgiref.sync import sync_to_async
from django.test import Client

from hub import index, locks, writes
from hub.jobs import upload as upload_jobs
from hub.models import ModelArtifact, PrefixLock, UploadJob
from hub.store import FilesystemModelStore, get_store
from tests.conftest import bearer
from tests.hub.conftest import make_model_dir, minio_store_for, run_uploads

pytestmark = pytest.mark.django_db


def _post(key: str, url: str, body: dict | None = None):
    return Client().post(url, data=json.dumps(body or {}), content_type="application/json", **bearer(key))


def _upload(key: str, local_path, *, name: str = "m", fmt: str = "gguf", **extra):
    return _post(key, "/api/storage/upload", {"local_path": str(local_path), "format": fmt, "name": name, **extra})


def _error(resp, status: int, code: str) -> str:
    assert resp.status_code == status, resp.content
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "code"} and err["code"] == code, err
    return err["message"]


class SlowStore(FilesystemModelStore):
    """The filesystem store, pausing after every chunk it writes (a big file, in small bytes)."""

    pause_s = 0.15

    def put_file(self, key, local, *, progress=None, cancel=None):
        def slow(n: int) -> None:
            if progress:
                progress(n)
            time.sleep(self.pause_s)

        return super().put_file(key, local, progress=slow, cancel=cancel)


# ---------------------------------------------------------------- the job's life
def test_an_upload_is_a_job_the_nodes_agent_runs(hub_dirs, settings, operator, viewer, tmp_path):
    src = make_model_dir(tmp_path / "src", {"a.gguf": b"a" * 1000, "b.gguf": b"b" * 500})
    assert _upload(viewer.key, src).status_code == 403
    resp = _upload(operator.key, src, name="job-model")
    assert resp.status_code == 202, resp.content
    job = resp.json()
    assert {k: job[k] for k in ("status", "bytes_done", "bytes_total", "error", "prefix", "node", "replace")} == {
        "status": "PENDING", "bytes_done": 0, "bytes_total": 1500, "error": None, "prefix": "gguf/job-model",
        "node": settings.NODE_NAME, "replace": False}
    assert job["created_by"] == operator.user.username
    assert not ModelArtifact.objects.exists()  # nothing is written by the request
    assert run_uploads(node="another-node") == []  # only the agent of the job's node takes it
    [done] = run_uploads()
    assert (done.status, done.bytes_done, done.bytes_total, done.error) == ("COMPLETED", 1500, 1500, "")
    assert done.started_at and done.finished_at
    got = Client().get(f"/api/storage/uploads/{job['id']}", **bearer(viewer.key)).json()
    assert (got["status"], got["bytes_done"]) == ("COMPLETED", 1500)
    assert [j["id"] for j in Client().get("/api/storage/uploads", **bearer(viewer.key)).json()] == [job["id"]]
    assert Client().get("/api/storage/uploads/999", **bearer(viewer.key)).status_code == 404
    assert ModelArtifact.objects.get(prefix="gguf/job-model").complete
    assert not PrefixLock.objects.exists()  # the lock went with the job


def test_two_agents_never_claim_one_upload(hub_dirs, settings, tmp_path):
    src = make_model_dir(tmp_path / "src", {"a.gguf": b"a"})
    job = upload_jobs.create_upload_job(local_path=str(src), format="gguf", name="once")
    first = upload_jobs.claim_next_upload(node_name=settings.NODE_NAME)
    assert first.pk == job.pk and first.status == "UPLOADING"
    assert upload_jobs.claim_next_upload(node_name=settings.NODE_NAME) is None


def test_a_path_on_another_node_is_checked_by_that_nodes_agent(hub_dirs, settings, operator, tmp_path):
    from hardware.models import Node

    _error(_upload(operator.key, "/models/x.gguf", node="nowhere"), 400, "invalid_request")
    _error(_upload(operator.key, "relative.gguf", node="gpu-2"), 400, "invalid_request")
    Node.objects.create(name="gpu-2", address="10.0.0.2")
    # Not on this server's disk: the request cannot look, the job goes to gpu-2's agent.
    resp = _upload(operator.key, "/models/on-gpu-2.gguf", node="gpu-2", name="remote")
    assert resp.status_code == 202 and resp.json()["node"] == "gpu-2"
    assert run_uploads() == []
    [failed] = run_uploads(node="gpu-2")  # that agent runs every check of check_import_path on its disk
    assert failed.status == "FAILED" and "not under XGEN_IMPORT_DIRS" in failed.error
    assert not ModelArtifact.objects.exists() and not PrefixLock.objects.exists()


def test_the_upload_page_lists_jobs_from_the_database(hub_dirs, admin, tmp_path):
    src = make_model_dir(tmp_path / "src", {"p.gguf": b"p" * 10})
    other = upload_jobs.create_upload_job(local_path=str(src), format="gguf", name="elsewhere")  # any web process
    c = Client()
    c.force_login(admin.user)
    page = c.get("/models/upload/").content.decode()
    assert f'id="upload-{other.pk}"' in page and 'data-status="PENDING"' in page
    assert f"/models/uploads/{other.pk}/cancel/" in page
    assert c.post(f"/models/uploads/{other.pk}/cancel/").status_code == 302
    assert UploadJob.objects.get(pk=other.pk).status == "CANCELLED"
    resp = c.post("/models/upload/", {"local_path": str(src), "format": "gguf", "name": "elsewhere"})
    assert resp.status_code == 302  # the cancelled job freed the name
    [done] = run_uploads()
    assert done.created_by == admin.user and done.status == "COMPLETED"
    assert 'data-status="COMPLETED"' in c.get("/models/upload/").content.decode()


# ---------------------------------------------------------------- one writer per model (issue 17 #5)
def test_a_second_writer_of_one_model_gets_409_until_the_first_ends(hub_dirs, operator, admin, tmp_path):
    x = make_model_dir(tmp_path / "x", {"a-first.gguf": b"a" * 1000, "z-big.gguf": b"z" * 5000})
    y = make_model_dir(tmp_path / "y", {"m-other.gguf": b"m" * 800})
    first = _upload(operator.key, x, name="acme_race")
    assert first.status_code == 202
    message = _error(_upload(operator.key, y, name="acme_race"), 409, "model_busy")
    assert "gguf/acme_race" in message and f"upload job {first.json()['id']}" in message
    # A download to the same model, a delete of it, and the page's form wait their turn too.
    _error(_post(operator.key, "/api/download", {"repo_id": "acme/race", "format": "gguf"}), 409, "model_busy")
    _error(Client().delete("/api/storage/models/gguf/acme_race", **bearer(admin.key)), 409, "model_busy")
    c = Client()
    c.force_login(operator.user)
    resp = c.post("/models/upload/", {"local_path": str(y), "format": "gguf", "name": "acme_race"})
    assert resp.status_code == 409 and "is being written by upload job" in resp.content.decode()
    assert UploadJob.objects.count() == 1
    [done] = run_uploads()
    assert done.status == "COMPLETED"
    store = get_store()
    assert sorted(f.path for f in store.read_manifest("gguf/acme_race").files) == ["a-first.gguf", "z-big.gguf"]
    # Now the name is free: the second upload is refused only because the model is complete.
    _error(_upload(operator.key, y, name="acme_race"), 409, "model_exists")


def test_a_lock_whose_holder_has_ended_is_taken_over(hub_dirs, tmp_path):
    src = make_model_dir(tmp_path / "src", {"a.gguf": b"a"})
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    for holder in ("upload:9999", f"cli:{socket.gethostname()}:{dead}"):
        PrefixLock.objects.create(prefix="gguf/stale", holder=holder)
        job = upload_jobs.create_upload_job(local_path=str(src), format="gguf", name="stale")
        assert PrefixLock.objects.get(prefix="gguf/stale").holder == f"upload:{job.pk}"
        upload_jobs.request_upload_cancel(job=job)
        assert not PrefixLock.objects.exists()
    PrefixLock.objects.create(prefix="gguf/stale", holder=f"cli:{socket.gethostname()}:{os.getpid()}")
    with pytest.raises(locks.PrefixBusy, match="manage.py hub_upload"):
        upload_jobs.create_upload_job(local_path=str(src), format="gguf", name="stale")


def test_hub_upload_holds_the_lock_and_refuses_to_overwrite(hub_dirs, tmp_path, capsys):
    from django.core.management import CommandError, call_command

    src = make_model_dir(tmp_path / "src", {"cli.gguf": b"c" * 100})
    job = upload_jobs.create_upload_job(local_path=str(src), format="gguf", name="cli")
    with pytest.raises(CommandError, match=f"being written by upload job {job.pk}"):
        call_command("hub_upload", str(src), "--format", "gguf", "--name", "cli")
    upload_jobs.request_upload_cancel(job=job)
    call_command("hub_upload", str(src), "--format", "gguf", "--name", "cli")
    assert "gguf/cli: 1 files, 100 bytes" in capsys.readouterr().out
    (src / "cli.gguf").write_bytes(b"d" * 50)
    with pytest.raises(CommandError, match="already a complete model.*--replace"):
        call_command("hub_upload", str(src), "--format", "gguf", "--name", "cli")
    call_command("hub_upload", str(src), "--format", "gguf", "--name", "cli", "--replace")
    assert get_store().get_bytes("gguf/cli/cli.gguf") == b"d" * 50
    assert not PrefixLock.objects.exists()


# ---------------------------------------------------------------- re-uploads (issue 17 #6)
def _victim(tmp_path, operator) -> tuple[dict, object]:
    """gguf/victim, uploaded and complete; returns its manifest's files and the store."""
    src = make_model_dir(tmp_path / "v1", {"model.gguf": b"1" * 300_000})
    assert _upload(operator.key, src, name="victim").status_code == 202
    assert [j.status for j in run_uploads()] == ["COMPLETED"]
    store = get_store()
    return store.read_manifest("gguf/victim"), store


def test_a_complete_model_is_not_overwritten_unless_asked(hub_dirs, operator, tmp_path):
    before, store = _victim(tmp_path, operator)
    v2 = make_model_dir(tmp_path / "v2", {"model.gguf": b"2" * 100_000})
    message = _error(_upload(operator.key, v2, name="victim"), 409, "model_exists")
    assert "gguf/victim" in message and not UploadJob.objects.filter(status="PENDING").exists()
    assert store.read_manifest("gguf/victim") == before  # untouched: still loadable
    assert store.get_bytes("gguf/victim/model.gguf") == b"1" * 300_000
    assert _upload(operator.key, v2, name="victim", replace=True).status_code == 202
    [done] = run_uploads()
    assert done.status == "COMPLETED" and done.replace
    assert store.get_bytes("gguf/victim/model.gguf") == b"2" * 100_000
    assert ModelArtifact.objects.get(prefix="gguf/victim").size_bytes == 100_000


def test_a_replace_whose_file_vanishes_mid_copy_leaves_the_old_model(hub_dirs, operator, tmp_path):
    before, _ = _victim(tmp_path, operator)
    v2 = make_model_dir(tmp_path / "v2", {"a.gguf": b"a" * 2 * 2**20, "b.gguf": b"b" * 1000})
    assert _upload(operator.key, v2, name="victim", replace=True).status_code == 202
    listed_during: list[bool] = []

    def progress(done: int, total: int) -> None:  # while a.gguf is copied, b.gguf goes away
        listed_during.append(ModelArtifact.objects.get(prefix="gguf/victim").complete)
        (v2 / "b.gguf").unlink(missing_ok=True)

    job = upload_jobs.claim_next_upload(node_name=UploadJob.objects.first().node)
    failed = upload_jobs.execute_upload(job.pk, progress=progress)
    assert failed.status == "FAILED" and "b.gguf went away after it was checked" in failed.error
    assert listed_during and all(listed_during)  # the old model stayed listed complete (issue 34 #10)
    store = get_store()
    assert store.read_manifest("gguf/victim") == before  # and loadable, as it was
    assert ModelArtifact.objects.filter(prefix="gguf/victim", complete=True).exists()
    assert [o.key for o in store.list_files("gguf/victim")] == ["gguf/victim/model.gguf"]
    assert store.get_bytes("gguf/victim/model.gguf") == b"1" * 300_000
    assert list(store.iter_objects(".xgen-staging/")) == []  # what the failed replace wrote was removed
    assert not PrefixLock.objects.exists()


@pytest.mark.django_db(transaction=True)
async def test_a_replace_cut_off_by_the_store_is_never_listed_complete(hub_dirs, operator, tmp_path, counting_s3,
                                                                       s3, settings):
    """The issue's case on S3: re-uploading gguf/victim while the store goes away mid-copy."""
    from hub.uploads import run_upload_job

    store = minio_store_for(counting_s3.endpoint)
    direct = minio_store_for(s3)
    v1 = make_model_dir(tmp_path / "v1", {"model.gguf": b"1" * 300_000})
    await sync_to_async(writes.write_model)("gguf/victim", v1, store=store)
    assert (await sync_to_async(ModelArtifact.objects.get)(prefix="gguf/victim")).complete
    v2 = make_model_dir(tmp_path / "v2", {"model.gguf": b"2" * 300_000, "more.gguf": b"3" * 300_000})
    job = await sync_to_async(upload_jobs.create_upload_job)(local_path=str(v2), format="gguf", name="victim",
                                                          replace=True, store=store)
    await sync_to_async(upload_jobs.claim_next_upload)(node_name=job.node)
    counting_s3.reset()
    counting_s3.put_delay = 0.5
    task = asyncio.create_task(run_upload_job(job.pk, store=store))
    for _ in range(200):
        await asyncio.sleep(0.05)
        with counting_s3.lock:
            if any(method == "POST" for method, _ in counting_s3.counts):  # the old manifest's delete
                break
    counting_s3.dead = True  # the store goes away with the copy under way
    failed = await asyncio.wait_for(task, 120)
    assert failed.status == "FAILED" and "The model store failed" in failed.error, failed.error
    row = await sync_to_async(ModelArtifact.objects.filter(prefix="gguf/victim").first)()
    assert row is None or not row.complete  # the index never calls it complete
    assert direct.read_manifest("gguf/victim") is None  # and the store agrees: nothing loadable
    assert not await sync_to_async(PrefixLock.objects.exists)()


# ---------------------------------------------------------------- cancel, agent restarts
@pytest.mark.django_db(transaction=True)
async def test_cancel_stops_a_running_upload_and_leaves_nothing(hub_dirs, operator, tmp_path):
    from hub.uploads import run_upload_job

    store = SlowStore(hub_dirs / "store")
    src = make_model_dir(tmp_path / "src", {"big.gguf": os.urandom(8 * 2**20), "small.gguf": b"s" * 10})
    job = await sync_to_async(upload_jobs.create_upload_job)(local_path=str(src), format="gguf", name="cancelled")
    await sync_to_async(upload_jobs.claim_next_upload)(node_name=job.node)
    task = asyncio.create_task(run_upload_job(job.pk, store=store))
    for _ in range(100):
        await asyncio.sleep(0.05)
        current = await sync_to_async(UploadJob.objects.get)(pk=job.pk)
        if current.bytes_done:
            break
    assert current.status == "UPLOADING" and 0 < current.bytes_done < current.bytes_total  # live progress
    resp = await sync_to_async(_post)(operator.key, f"/api/storage/uploads/{job.pk}/cancel")
    assert resp.status_code == 200 and resp.json()["status"] == "UPLOADING"  # asked; the agent stops it
    done = await asyncio.wait_for(task, 30)
    assert done.status == "CANCELLED" and "Cancelled by a user" in done.error
    assert store.scan_models() == []
    assert not await sync_to_async(ModelArtifact.objects.exists)()
    assert not await sync_to_async(PrefixLock.objects.exists)()


def test_a_pending_upload_is_cancelled_at_once(hub_dirs, operator, viewer, tmp_path):
    src = make_model_dir(tmp_path / "src", {"a.gguf": b"a"})
    job = _upload(operator.key, src, name="never").json()
    assert _post(viewer.key, f"/api/storage/uploads/{job['id']}/cancel").status_code == 403
    cancelled = _post(operator.key, f"/api/storage/uploads/{job['id']}/cancel").json()
    assert cancelled["status"] == "CANCELLED" and cancelled["error"] == "Cancelled before it started."
    assert run_uploads() == [] and not PrefixLock.objects.exists()


def test_an_upload_cut_short_by_an_agent_restart_fails_with_the_reason(hub_dirs, settings, tmp_path):
    src = make_model_dir(tmp_path / "src", {"a.gguf": b"a" * 10})
    job = upload_jobs.create_upload_job(local_path=str(src), format="gguf", name="orphan")
    upload_jobs.claim_next_upload(node_name=settings.NODE_NAME)
    store = get_store()
    store.put_bytes("gguf/orphan/a.gguf", b"a" * 4)  # what it had written when the agent died
    index.index_prefix("gguf/orphan", store=store)
    waiting = upload_jobs.create_upload_job(local_path=str(src), format="gguf", name="later")
    assert upload_jobs.fail_orphaned_uploads(node_name=settings.NODE_NAME) == 1
    job.refresh_from_db()
    assert job.status == "FAILED" and "node agent restarted" in job.error
    assert store.list_files("gguf/orphan") == [] and not ModelArtifact.objects.filter(prefix="gguf/orphan").exists()
    assert UploadJob.objects.get(pk=waiting.pk).status == "PENDING"  # not claimed yet: it still runs
    assert list(PrefixLock.objects.values_list("prefix", flat=True)) == ["gguf/later"]


@pytest.mark.django_db(transaction=True)
async def test_the_hub_worker_runs_uploads_and_fails_what_a_restart_cut_short(hub_dirs, settings, tmp_path):
    from types import SimpleNamespace

    from hub.worker import HubWorker

    agent = SimpleNamespace(name=settings.NODE_NAME)
    src = make_model_dir(tmp_path / "src", {"w.gguf": b"w" * 1000})
    cut = await sync_to_async(upload_jobs.create_upload_job)(local_path=str(src), format="gguf", name="cut")
    await sync_to_async(upload_jobs.claim_next_upload)(node_name=agent.name)  # claimed by the agent before
    job = await sync_to_async(upload_jobs.create_upload_job)(local_path=str(src), format="gguf", name="worked")
    worker = HubWorker()
    await worker.start(agent)
    cut = await sync_to_async(UploadJob.objects.get)(pk=cut.pk)
    assert cut.status == "FAILED" and "restarted" in cut.error
    run = asyncio.create_task(worker.run(agent))
    try:
        for _ in range(200):
            await asyncio.sleep(0.05)
            job = await sync_to_async(UploadJob.objects.get)(pk=job.pk)
            if not job.is_active:
                break
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        await worker.stop(agent)
    assert job.status == "COMPLETED", job.error
    assert (await sync_to_async(ModelArtifact.objects.get)(prefix="gguf/worked")).complete
