"""Downloads follow the rule of uploads (issue 34 #11): 409 `model_exists` for a model the store
holds unless `replace: true`, and a name made from a repo id that another model holds (an upload,
or `own/rep` vs `own_rep`) is refused with 409 `name_collision`, whatever `replace` says. A
replacing download that fails or is cancelled leaves the old model as it was (#10)."""
from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from asgiref.sync import sync_to_async
from django.test import Client

from hub import index
from hub.downloads import run_download_job
from hub.jobs import download as download_jobs
from hub.models import DownloadJob, ModelArtifact
from hub.store import FilesystemModelStore, get_store
from tests.conftest import bearer
from tests.hub.conftest import make_model_dir
from tests.hub.fake_hf import FakeHub


def _download(key: str, **body):
    return Client().post("/api/download", json.dumps({"format": "gguf", **body}), content_type="application/json",
                         **bearer(key))


def _downloaded(tmp_path, prefix: str, repo_id: str) -> None:
    get_store().upload_model(prefix, make_model_dir(tmp_path / prefix.replace("/", "_"), {"m.gguf": b"GGUF1"}),
                             source={"repo_id": repo_id, "revision": "main"})


@pytest.mark.django_db
def test_a_download_over_a_model_needs_replace(hub_dirs, operator, tmp_path):
    _downloaded(tmp_path, "gguf/own_rep", "own/rep")
    resp = _download(operator.key, repo_id="own/rep")
    assert resp.status_code == 409, resp.content
    error = resp.json()["error"]
    assert error["code"] == "model_exists" and "replace: true" in error["message"]
    assert not DownloadJob.objects.exists()
    resp = _download(operator.key, repo_id="own/rep", replace=True)
    assert resp.status_code == 202 and resp.json()["replace"] is True
    assert DownloadJob.objects.get().replace


@pytest.mark.django_db
def test_a_name_held_by_another_origin_is_refused_even_with_replace(hub_dirs, operator, tmp_path):
    _downloaded(tmp_path, "gguf/own_rep", "own/rep")
    get_store().upload_model("gguf/mine", make_model_dir(tmp_path / "up", {"m.gguf": b"GGUF2"}),
                             source={"local_path": "/x/m.gguf"})
    for repo_id, held in (("own_rep", "a download of own/rep"), ("mine", "an upload")):
        for replace in (False, True):
            resp = _download(operator.key, repo_id=repo_id, replace=replace)
            assert resp.status_code == 409, resp.content
            error = resp.json()["error"]
            assert error["code"] == "name_collision" and held in error["message"], error
    assert not DownloadJob.objects.exists()
    assert get_store().get_bytes("gguf/mine/m.gguf") == b"GGUF2"


@pytest.mark.django_db
def test_the_downloads_page_answers_409_not_500(hub_dirs, operator, tmp_path):
    _downloaded(tmp_path, "gguf/own_rep", "own/rep")
    client = Client()
    client.force_login(operator.user)
    resp = client.post("/downloads/", {"repo_id": "own/rep", "format": "gguf"})
    assert resp.status_code == 409 and "replace" in resp.content.decode()


@pytest.mark.django_db(transaction=True)
async def test_a_cancelled_replacing_download_leaves_the_old_model(monkeypatch, hub_dirs, settings, tmp_path):
    settings.DATA_DIR = hub_dirs
    store = FilesystemModelStore(hub_dirs / "store")
    await sync_to_async(store.upload_model)(
        "huggingface/acme_slow", make_model_dir(tmp_path / "old", {"config.json": b'{"old": 1}'}),
        source={"repo_id": "acme/slow"})
    before = store.read_manifest("huggingface/acme_slow")
    await sync_to_async(index.index_prefix)("huggingface/acme_slow", store=store)
    slow = FakeHub({"acme/slow": {"config.json": b"{}", "big.bin": os.urandom(6_000_000)}}).start()
    monkeypatch.setenv("HF_ENDPOINT", slow.url)

    class SlowWrites(FilesystemModelStore):  # the upload to the store takes a while: time to cancel it
        def put_file(self, key, local, *, progress=None, cancel=None):
            def slowly(n: int) -> None:
                time.sleep(0.3)
                if progress:
                    progress(n)
            return super().put_file(key, local, progress=slowly, cancel=cancel)

    try:
        job = await sync_to_async(download_jobs.create_download_job)(repo_id="acme/slow", format="huggingface",
                                                                 replace=True, store=store)
        await sync_to_async(download_jobs.claim_next_job)(node_name="n1")
        task = asyncio.create_task(run_download_job(job.pk, node_name="n1", store=SlowWrites(hub_dirs / "store")))
        for _ in range(400):
            await asyncio.sleep(0.05)
            current = await sync_to_async(DownloadJob.objects.get)(pk=job.pk)
            if current.status == "UPLOADING" and current.bytes_done > 0:
                break
        assert current.status == "UPLOADING"
        row = await sync_to_async(ModelArtifact.objects.get)(prefix="huggingface/acme_slow")
        assert row.complete  # listed complete while its replacement is being written
        await sync_to_async(download_jobs.request_cancel)(job=current)
        done = await asyncio.wait_for(task, 60)
    finally:
        slow.stop()
    assert done.status == "CANCELLED"
    assert store.read_manifest("huggingface/acme_slow") == before
    assert store.get_bytes("huggingface/acme_slow/config.json") == b'{"old": 1}'
    row = await sync_to_async(ModelArtifact.objects.get)(prefix="huggingface/acme_slow")
    assert row.complete and row.file_count == 1
