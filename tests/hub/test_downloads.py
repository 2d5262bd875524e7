"""Download jobs end to end: a fake Hub on loopback (through HF_ENDPOINT), the child process,
progress, the upload to the real S3 endpoint, failures and cancel."""
from __future__ import annotations

import asyncio
import os

import pytest
from asgiref.sync import sync_to_async

from hub import locks
from hub.downloads import run_download_job
from hub.jobs import download as download_jobs
from hub.models import DownloadJob, ModelArtifact
from hub.paths import MANIFEST_NAME
from tests.hub.conftest import minio_store_for
from tests.hub.fake_hf import FakeHub

pytestmark = pytest.mark.django_db(transaction=True)

REPO_FILES = {
    "config.json": b'{"model_type": "llama"}',
    "model-00001.safetensors": os.urandom(400_000),
    "model-00002.safetensors": os.urandom(300_000),
    "tokenizer/tokenizer.json": b"{}",
}


@pytest.fixture
def fake_hub(monkeypatch):
    hub = FakeHub({"acme/tiny-model": REPO_FILES}).start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    yield hub
    hub.stop()


def _new_job(**kw) -> DownloadJob:
    job = download_jobs.create_download_job(**{"repo_id": "acme/tiny-model", "format": "huggingface", **kw})
    claimed = download_jobs.claim_next_job(node_name="n1")
    assert claimed.pk == job.pk and claimed.status == "DOWNLOADING"
    return claimed


async def test_a_download_ends_completed_with_the_files_in_the_store(fake_hub, s3, hub_dirs, settings):
    settings.DATA_DIR = hub_dirs
    store = minio_store_for(s3)
    job = await sync_to_async(_new_job)()
    done = await run_download_job(job.pk, node_name="n1", store=store)
    assert (done.status, done.error) == ("COMPLETED", "")
    total = sum(map(len, REPO_FILES.values()))
    assert done.bytes_done == done.bytes_total == total
    assert {f["path"] for f in done.files} == set(REPO_FILES)
    manifest = store.read_manifest("huggingface/acme_tiny-model")
    assert {f.path: f.size for f in manifest.files} == {p: len(d) for p, d in REPO_FILES.items()}
    assert manifest.source["repo_id"] == "acme/tiny-model"
    assert store.get_bytes("huggingface/acme_tiny-model/model-00002.safetensors") == REPO_FILES["model-00002.safetensors"]
    art = await sync_to_async(ModelArtifact.objects.get)(prefix="huggingface/acme_tiny-model")
    assert art.complete and art.size_bytes == total and art.source_repo == "acme/tiny-model"
    assert not (hub_dirs / "downloads" / f"job-{job.pk}").exists()


async def test_allow_patterns_limit_the_files(fake_hub, hub_dirs, settings):
    settings.DATA_DIR = hub_dirs
    from hub.store import FilesystemModelStore

    store = FilesystemModelStore(hub_dirs / "store")
    job = await sync_to_async(_new_job)(allow_patterns=["*.json"])
    done = await run_download_job(job.pk, node_name="n1", store=store)
    assert done.status == "COMPLETED"
    assert {f.path for f in store.read_manifest(done.target_prefix).files} == {"config.json", "tokenizer/tokenizer.json"}


async def test_an_unknown_repo_fails_with_a_readable_message(fake_hub, hub_dirs, settings):
    settings.DATA_DIR = hub_dirs
    from hub.store import FilesystemModelStore

    job = await sync_to_async(_new_job)(repo_id="nobody/no-such-model")
    done = await run_download_job(job.pk, node_name="n1", store=FilesystemModelStore(hub_dirs / "store"))
    assert done.status == "FAILED"
    assert done.error.startswith("Repository not found: nobody/no-such-model")


async def test_the_store_going_away_mid_upload_fails_and_leaves_no_model(fake_hub, counting_s3, s3, hub_dirs, settings):
    settings.DATA_DIR = hub_dirs
    store = minio_store_for(counting_s3.endpoint)
    store.scan_models()  # bucket ready
    counting_s3.put_delay = 0.4
    job = await sync_to_async(_new_job)()
    task = asyncio.create_task(run_download_job(job.pk, node_name="n1", store=store))
    for _ in range(200):
        await asyncio.sleep(0.05)
        current = await sync_to_async(DownloadJob.objects.get)(pk=job.pk)
        if current.status == "UPLOADING":
            break
    assert current.status == "UPLOADING"
    counting_s3.dead = True
    done = await asyncio.wait_for(task, 60)
    assert done.status == "FAILED" and done.error
    direct = minio_store_for(s3)
    assert direct.read_manifest(done.target_prefix) is None
    assert not any(m.complete for m in direct.scan_models())
    assert not any(o.key.endswith(MANIFEST_NAME) for o in direct.iter_objects("huggingface/"))


async def test_cancel_kills_the_child_and_cleans_up(monkeypatch, hub_dirs, settings):
    settings.DATA_DIR = hub_dirs
    slow = FakeHub({"acme/slow": {"config.json": b"{}", "big.bin": os.urandom(2_000_000)}},
                   delay_per_chunk=0.05, chunk=32 * 1024).start()
    monkeypatch.setenv("HF_ENDPOINT", slow.url)
    from hub.store import FilesystemModelStore

    store = FilesystemModelStore(hub_dirs / "store")
    try:
        job = await sync_to_async(_new_job)(repo_id="acme/slow")
        task = asyncio.create_task(run_download_job(job.pk, node_name="n1", store=store))
        for _ in range(200):
            await asyncio.sleep(0.05)
            current = await sync_to_async(DownloadJob.objects.get)(pk=job.pk)
            if current.bytes_done > 0:
                break
        assert 0 < current.bytes_done < current.bytes_total  # progress while bytes arrive
        await sync_to_async(download_jobs.request_cancel)(job=current)
        done = await asyncio.wait_for(task, 30)
    finally:
        slow.stop()
    assert done.status == "CANCELLED"
    assert not (hub_dirs / "downloads" / f"job-{job.pk}").exists()
    assert store.scan_models() == []


def test_two_agents_never_claim_one_job(db):
    job = download_jobs.create_download_job(repo_id="acme/x", format="gguf")
    first = download_jobs.claim_next_job(node_name="a")
    second = download_jobs.claim_next_job(node_name="b")
    assert first.pk == job.pk and first.node == "a" and second is None


def test_a_pending_job_is_cancelled_at_once(db):
    job = download_jobs.create_download_job(repo_id="acme/x", format="gguf")
    assert download_jobs.request_cancel(job=job).status == "CANCELLED"
    assert download_jobs.claim_next_job(node_name="a") is None


@pytest.mark.django_db(transaction=True)
def test_a_kill_9_mid_download_leaves_a_child_the_restarted_agent_stops(hub_dirs, settings):
    """Issue 34 #12: the download child runs in its own session, so it outlives a `kill -9` of the
    agent; its pid/pgid are on the job, and the agent's start stops it and removes its folders."""
    import signal
    import subprocess
    import time

    from django.db import connection

    from tests.conftest import REPO
    from tests.procs import PYTHON

    settings.DATA_DIR = hub_dirs
    slow = FakeHub({"acme/slow": {"config.json": b"{}", "big.bin": os.urandom(3_000_000)}},
                   delay_per_chunk=0.05, chunk=32 * 1024).start()
    job = _new_job(repo_id="acme/slow")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "xgenconsole.settings", "XGEN_DATA_DIR": str(hub_dirs),
           "DATABASE_URL": f"sqlite:///{connection.settings_dict['NAME']}", "HF_ENDPOINT": slow.url}
    agent = subprocess.Popen([PYTHON, "-m", "tests.hub.download_child", str(job.pk), str(hub_dirs / "store")],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            job.refresh_from_db()
            if job.pgid and job.bytes_done > 0:
                break
            assert agent.poll() is None, agent.stdout.read().decode()
            time.sleep(0.1)
        assert job.pgid and 0 < job.bytes_done < job.bytes_total, (job.pgid, job.bytes_done)
        os.kill(agent.pid, signal.SIGKILL)  # the console dies mid-download
        agent.wait(10)
        dest, hf_home = download_jobs.download_dirs(job.pk)
        assert download_jobs._is_download_child(job.pgid, job.pk)  # the child lives on, orphaned
        assert dest.is_dir()
        stray = dest.parent / "job-999999-hfhome"  # a job whose agent died before its pid was stored
        stray.mkdir()
        assert download_jobs.fail_orphaned_jobs(node_name="n1") == 1  # what the restarted agent does first
        assert not download_jobs._is_download_child(job.pgid, job.pk)
        assert not dest.exists() and not hf_home.exists() and not stray.exists()
        job.refresh_from_db()
        assert job.status == "FAILED" and "its download process was stopped" in job.error
        assert job.pid is None and job.pgid is None
        assert locks.lock_prefix(job.target_prefix, holder="cli:x:1") is None  # the lock was freed
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        agent.stdout.close()
        slow.stop()
