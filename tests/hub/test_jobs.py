"""One job model for uploads, downloads and node-cache jobs (hub.models.Job): the rows of the
three old tables migrate into it with their ids, and the one lifecycle (hub.jobs) holds for
every kind: a finished job is never reopened."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from hub import jobs
from hub.jobs import download as download_jobs
from hub.jobs import upload as upload_jobs
from hub.locks import busy_prefixes, lock_prefix
from hub.models import CacheJob, DownloadJob, Job, PrefixLock, UploadJob
from tests.conftest import bearer
from tests.migrations import latest as _latest
from tests.migrations import migrate_to as _migrate

BEFORE = [("hub", "0006_download_replace_and_child")]


def _old_rows(apps, user) -> dict:
    """Rows of each old kind made through the old schema, their ids overlapping across kinds."""
    Download = apps.get_model("hub", "DownloadJob")
    Upload = apps.get_model("hub", "UploadJob")
    Cache = apps.get_model("hub", "CacheJob")
    Lock = apps.get_model("hub", "PrefixLock")
    t0 = timezone.now() - timedelta(days=3)
    d1 = Download.objects.create(repo_id="acme/one", revision="main", format="gguf", allow_patterns=["*.gguf"],
                                 status="COMPLETED", bytes_done=10, bytes_total=10, target_prefix="gguf/acme_one",
                                 node="n1", files=[{"path": "a.gguf", "size": 10, "done": 10}], replace=True,
                                 created_by_id=user.pk, created_at=t0, started_at=t0, finished_at=t0)
    d2 = Download.objects.create(repo_id="acme/two", format="huggingface", status="FAILED", error="Repository not found",
                                 target_prefix="huggingface/acme_two", created_at=t0 + timedelta(hours=1))
    uploads = [Upload.objects.create(local_path=f"/imports/m{i}.gguf", format="gguf", target_prefix=f"gguf/m{i}",
                                     node="n1", status="COMPLETED", bytes_done=5, bytes_total=5, created_by_id=user.pk,
                                     created_at=t0 + timedelta(minutes=i)) for i in range(4)]
    # An upload still queued: it holds its model's lock, by its id, across the upgrade.
    queued = Upload.objects.create(local_path="/imports/q.gguf", format="gguf", target_prefix="gguf/q", node="n2",
                                   replace=True)
    Lock.objects.create(prefix="gguf/q", holder=f"upload:{queued.pk}")
    cache = Cache.objects.create(node="n1", prefix="gguf/m0", action="verify", status="COMPLETED",
                                 result={"ok": False, "problems": ["m0.gguf: missing"]}, created_by_id=user.pk,
                                 finished_at=t0)
    return {"downloads": [d1.pk, d2.pk], "uploads": [u.pk for u in uploads], "queued": queued.pk,
            "cache": cache.pk}


@pytest.mark.django_db(transaction=True)
def test_rows_of_each_old_kind_migrate_into_one_job_table_with_their_ids(operator, viewer):
    from accounts.models import User

    user = User.objects.create(username="old-operator")  # users are no part of these migrations
    apps = _migrate(BEFORE)
    try:
        made = _old_rows(apps, user)
    finally:
        _migrate(_latest())
    n_old = len(made["downloads"]) + len(made["uploads"]) + 2
    assert Job.objects.count() == n_old
    assert sorted(DownloadJob.objects.values_list("number", flat=True)) == made["downloads"]
    assert sorted(UploadJob.objects.values_list("number", flat=True)) == [*made["uploads"], made["queued"]]
    assert list(CacheJob.objects.values_list("number", flat=True)) == [made["cache"]]
    # A download keeps its primary key too (number == pk); no two jobs share a primary key.
    assert all(j.pk == j.number for j in DownloadJob.objects.all())

    d1 = DownloadJob.objects.get(number=made["downloads"][0])
    assert (d1.repo_id, d1.revision, d1.format, d1.allow_patterns, d1.status, d1.target_prefix, d1.node, d1.replace,
            d1.files, d1.created_by.username) == ("acme/one", "main", "gguf", ["*.gguf"], "COMPLETED", "gguf/acme_one",
                                                  "n1", True, [{"path": "a.gguf", "size": 10, "done": 10}],
                                                  "old-operator")
    queued = UploadJob.objects.get(number=made["queued"])
    assert (queued.status, queued.local_path, queued.node, queued.replace, queued.is_active) == (
        "PENDING", "/imports/q.gguf", "n2", True, True)
    cache = CacheJob.objects.get(number=made["cache"])
    assert (cache.prefix, cache.action, cache.result["problems"]) == ("gguf/m0", "verify", ["m0.gguf: missing"])
    # The queued upload's lock still names a live holder; the job's cancel frees it.
    assert busy_prefixes() == {"gguf/q"}
    jobs.request_cancel(queued)
    assert not PrefixLock.objects.exists()

    # The API answers the old ids with their fields, per kind.
    c = Client()
    got = c.get(f"/api/storage/uploads/{made['uploads'][0]}", **bearer(viewer.key)).json()
    assert (got["id"], got["local_path"], got["prefix"], got["created_by"]) == (
        made["uploads"][0], "/imports/m0.gguf", "gguf/m0", "old-operator")
    got = c.get(f"/api/download/{made['downloads'][1]}", **bearer(viewer.key)).json()
    assert (got["id"], got["repo_id"], got["status"], got["error"]) == (
        made["downloads"][1], "acme/two", "FAILED", "Repository not found")
    got = c.get(f"/api/hardware/nodes/n1/cache/jobs/{made['cache']}", **bearer(viewer.key)).json()
    assert (got["id"], got["prefix"], got["action"], got["result"]["ok"]) == (made["cache"], "gguf/m0", "verify", False)

    # Jobs made after the upgrade: number == primary key, above every old id of any kind.
    new = UploadJob.objects.create(local_path="/imports/n.gguf", format="gguf", target_prefix="gguf/n", node="n1")
    assert new.number == new.pk > max(Job.objects.exclude(pk=new.pk).values_list("number", flat=True))
    assert UploadJob.objects.get(number=new.number).pk == new.pk

    # And back: the three tables again, every row under its old id.
    apps = _migrate(BEFORE)
    try:
        Upload = apps.get_model("hub", "UploadJob")
        assert sorted(Upload.objects.values_list("pk", flat=True)) == sorted(
            [*made["uploads"], made["queued"], new.number])
        assert apps.get_model("hub", "CacheJob").objects.get(pk=made["cache"]).prefix == "gguf/m0"
        assert apps.get_model("hub", "DownloadJob").objects.get(pk=made["downloads"][0]).files[0]["path"] == "a.gguf"
    finally:
        _migrate(_latest())


@pytest.mark.django_db
def test_a_finished_job_is_never_reopened():
    """update_job's rule ("never reopened"), held for every kind: a runner's late write (progress,
    or the UPLOADING step of a download) after a cancel or an agent's restart ended the job
    changes nothing, and does not take the model's lock back."""
    job = DownloadJob.objects.create(repo_id="acme/late", format="gguf", target_prefix="gguf/acme_late")
    lock_prefix(job.target_prefix, holder=jobs.holder(job))
    claimed = download_jobs.claim_next_job(node_name="n1")
    assert claimed.pk == job.pk and claimed.status == "DOWNLOADING"
    done = download_jobs.finish_job(job.pk, status="FAILED", error="The node agent stopped during this download.")
    assert done.status == "FAILED" and not PrefixLock.objects.exists()
    late = download_jobs.update_job(job.pk, status="UPLOADING", bytes_done=7)
    assert (late.status, late.bytes_done, late.error) == ("FAILED", 0, "The node agent stopped during this download.")
    assert download_jobs.finish_job(job.pk, status="COMPLETED").status == "FAILED"
    assert not busy_prefixes()

    upload = UploadJob.objects.create(local_path="/imports/x.gguf", format="gguf", target_prefix="gguf/x", node="n1")
    upload_jobs.request_upload_cancel(job=upload)
    assert upload_jobs.update_upload(upload.pk, bytes_done=3, status="UPLOADING").status == "CANCELLED"
    cache = CacheJob.objects.create(node="n1", target_prefix="gguf/x", action="evict")
    jobs.finish(CacheJob, cache.pk, status="COMPLETED", result={"freed_bytes": 1})
    assert jobs.update(CacheJob, cache.pk, status="RUNNING").status == "COMPLETED"


@pytest.mark.django_db
def test_each_kind_sees_only_its_own_rows():
    d = DownloadJob.objects.create(repo_id="a/b", format="gguf", target_prefix="gguf/a_b")
    u = UploadJob.objects.create(local_path="/i/u.gguf", format="gguf", target_prefix="gguf/u", node="n1")
    c = CacheJob.objects.create(node="n1", target_prefix="gguf/u", action="verify")
    assert (d.kind, u.kind, c.kind) == ("download", "upload", "cache")
    assert [j.pk for j in DownloadJob.objects.all()] == [d.pk]
    assert [j.pk for j in UploadJob.objects.all()] == [u.pk]
    assert [j.pk for j in CacheJob.objects.all()] == [c.pk]
    # Claims never cross kinds: the upload and the cache job are node n1's, the download anyone's.
    assert upload_jobs.claim_next_upload(node_name="n1").pk == u.pk
    assert download_jobs.claim_next_job(node_name="n1").pk == d.pk
    from hub.node_cache import claim_next_cache_job

    assert claim_next_cache_job(node_name="n1").pk == c.pk
    assert upload_jobs.claim_next_upload(node_name="n1") is None
