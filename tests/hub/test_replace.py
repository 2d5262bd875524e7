"""A replace writes beside the model and switches when complete (issue 34 #10): until then the old
model stays listed, complete and loadable; a cancel or a failure leaves it as it was. Both stores."""
from __future__ import annotations

import threading
import time

import pytest

from hub import writes
from hub.jobs import upload as upload_jobs
from hub.models import ModelArtifact
from tests.hub.conftest import make_model_dir, run_uploads

pytestmark = pytest.mark.django_db

OLD = {"okfile.gguf": b"GGUF" + b"o" * 300_000}
NEW = {"okfile.gguf": b"GGUF" + b"n" * 200_000, "extra.gguf": b"GGUF" + b"x" * 400_000}


def _old_model(store, tmp_path):
    writes.write_model("gguf/okfile", make_model_dir(tmp_path / "v1", OLD), store=store)
    return store.read_manifest("gguf/okfile")


def _assert_old_intact(store, before, tmp_path) -> None:
    from hub.cache import resolve_model_path, sync_to_cache

    assert store.read_manifest("gguf/okfile") == before
    assert {o.key: o.size for o in store.list_files("gguf/okfile")} == {"gguf/okfile/okfile.gguf": 300_004}
    assert store.get_bytes("gguf/okfile/okfile.gguf") == OLD["okfile.gguf"]
    row = ModelArtifact.objects.get(prefix="gguf/okfile")
    assert row.complete and row.size_bytes == 300_004
    local = sync_to_cache("gguf/okfile", node_name="n1", store=store)  # and loadable: the copy checks out
    assert resolve_model_path(local, "gguf").read_bytes() == OLD["okfile.gguf"]


def test_the_old_model_stays_complete_and_loadable_while_a_replace_runs(store, tmp_path):
    from hardware.services import register_node

    register_node(name="n1", address="127.0.0.1")
    before = _old_model(store, tmp_path)
    seen: list[tuple[bool, bool]] = []

    def midway(done: int, total: int) -> None:
        if 250_000 < done < total and not seen:
            row = ModelArtifact.objects.get(prefix="gguf/okfile")
            seen.append((store.read_manifest("gguf/okfile") == before, row.complete))
            raise RuntimeError("disk unplugged")

    with pytest.raises(RuntimeError, match="disk unplugged"):
        writes.write_model("gguf/okfile", make_model_dir(tmp_path / "v2", NEW), store=store, replace=True,
                             progress=midway)
    assert seen == [(True, True)]  # mid-way: still the old manifest, still listed complete
    _assert_old_intact(store, before, tmp_path)
    assert [o.key for o in store.iter_objects(".xgen-staging/")] == []  # nothing of the new one is left


def test_a_cancelled_replace_upload_job_leaves_the_model_untouched(store, tmp_path, settings):
    from hardware.services import register_node

    register_node(name="n1", address="127.0.0.1")
    settings.IMPORT_DIRS = [tmp_path.resolve()]
    before = _old_model(store, tmp_path)
    src = make_model_dir(tmp_path / "imports" / "v2", NEW)
    job = upload_jobs.create_upload_job(local_path=str(src), format="gguf", name="okfile", replace=True, store=store)
    cancel = threading.Event()

    def progress(done: int, total: int) -> None:
        if done > 300_000:  # a user presses Cancel half-way
            upload_jobs.request_upload_cancel(job=job)
            cancel.set()

    claimed = upload_jobs.claim_next_upload(node_name=settings.NODE_NAME)
    done = upload_jobs.execute_upload(claimed.pk, store=store, progress=progress, cancel=cancel)
    assert done.status == "CANCELLED" and "gguf/okfile, which it was to replace, is unchanged" in done.error
    _assert_old_intact(store, before, tmp_path)


def test_a_completed_replace_switches_to_the_new_files_only(store, tmp_path, settings):
    settings.IMPORT_DIRS = [tmp_path.resolve()]
    _old_model(store, tmp_path)
    src = make_model_dir(tmp_path / "imports" / "v2", NEW)
    upload_jobs.create_upload_job(local_path=str(src), format="gguf", name="okfile", replace=True, store=store)
    [job] = run_uploads(store=store)
    assert job.status == "COMPLETED", job.error
    manifest = store.read_manifest("gguf/okfile")
    assert sorted(f.path for f in manifest.files) == ["extra.gguf", "okfile.gguf"]
    assert {o.key: o.size for o in store.list_files("gguf/okfile")} == {
        "gguf/okfile/extra.gguf": 400_004, "gguf/okfile/okfile.gguf": 200_004}
    assert store.get_bytes("gguf/okfile/okfile.gguf") == NEW["okfile.gguf"]
    by_path = {o.key.rsplit("/", 1)[1]: o.etag for o in store.list_files("gguf/okfile")}
    assert all(f.etag == by_path[f.path] for f in manifest.files)  # the manifest names the objects as they are
    row = ModelArtifact.objects.get(prefix="gguf/okfile")
    assert row.complete and row.size_bytes == 600_008
    assert [o.key for o in store.iter_objects(".xgen-staging/")] == []


def test_a_switch_cut_short_by_the_store_is_finished_once_it_is_back(hub_dirs, counting_s3, s3):
    """On S3 the switch is a server-side copy per file: the store going away in the middle of it
    loses neither version; once it is back the agent finishes the switch (at start, and with each
    index refresh) and the new version is complete."""
    from tests.hub.conftest import minio_store_for

    store, direct = minio_store_for(counting_s3.endpoint), minio_store_for(s3)
    _old_model(store, tmp_path := hub_dirs)
    counting_s3.reset()
    out: dict = {}

    def write() -> None:
        try:
            writes.write_model("gguf/okfile", make_model_dir(tmp_path / "v2", NEW), store=store, replace=True)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    counting_s3.put_delay = 0.3
    writer = threading.Thread(target=write)
    writer.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
            method == "PUT" and path.endswith("/gguf/okfile/.xgen-manifest.json") and ".xgen-staging" in path
            for method, path in list(counting_s3.counts)):
        time.sleep(0.01)
    counting_s3.dead = True  # every file and the staged manifest are in: the store goes away mid-switch
    writer.join(120)
    assert "error" in out, "the write should have failed with the store gone"
    assert len(direct.staged_switches("gguf/okfile")) == 1, out  # kept
    counting_s3.dead = False
    counting_s3.put_delay = 0
    assert writes.finish_interrupted_switches(store=store) == ["gguf/okfile"]
    manifest = direct.read_manifest("gguf/okfile")
    assert sorted(f.path for f in manifest.files) == ["extra.gguf", "okfile.gguf"]
    assert direct.get_bytes("gguf/okfile/okfile.gguf") == NEW["okfile.gguf"]
    assert ModelArtifact.objects.get(prefix="gguf/okfile").complete
    assert list(direct.iter_objects(".xgen-staging/")) == []
