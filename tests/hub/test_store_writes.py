"""What a store write leaves and needs (issue 34 #13-#15): leftovers of a write that died are swept
at the agent's start and by delete (`*.xgen-part`, staging areas, incomplete S3 multipart uploads);
free space is checked before and during a write (a sparse file counts at its apparent size); every
file name of an upload folder is checked at the API, the error naming the file."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from django.test import Client

from hub import locks, writes
from hub.imports import UPLOAD_SCAN_MAX_ENTRIES
from hub.models import PrefixLock, UploadJob
from hub.store import FilesystemModelStore, StoreFull
from tests.conftest import bearer
from tests.hub.conftest import make_model_dir, minio_store_for

pytestmark = pytest.mark.django_db


def _upload(key: str, local_path, fmt: str = "gguf", name: str = "m"):
    body = {"local_path": str(local_path), "format": fmt, "name": name}
    return Client().post("/api/storage/upload", data=json.dumps(body), content_type="application/json",
                         **bearer(key))


# ---------------------------------------------------------------- #15 file names
@pytest.mark.parametrize("bad", ["a\\b.gguf", "tab\there.gguf", "nl\nx.gguf"])
def test_a_folder_with_a_bad_file_name_is_refused_at_the_api_naming_it(settings, hub_dirs, operator, bad):
    imports = hub_dirs / "imports"
    folder = make_model_dir(imports / "model", {"ok.gguf": b"GGUF", bad: b"GGUF"})
    settings.IMPORT_DIRS = [imports]
    resp = _upload(operator.key, folder)
    assert resp.status_code == 400, resp.content
    message = resp.json()["error"]["message"]
    assert repr(bad) in message and "Rename it" in message, message
    assert not UploadJob.objects.exists() and not PrefixLock.objects.exists()


# ---------------------------------------------------------------- #13 leftovers
def test_part_files_and_staging_areas_are_swept_at_start_except_a_live_writers(hub_dirs):
    store = FilesystemModelStore(hub_dirs / "store")
    store.upload_model("gguf/kept", make_model_dir(hub_dirs / "src", {"k.gguf": b"GGUF" * 10}))
    root = hub_dirs / "store"
    # What a kill -9 mid-upload leaves: a part file in the model's folder (0.2's writes) and a staging area.
    (root / "gguf/kept/big.gguf.1a2b3c4d.xgen-part").write_bytes(b"x" * 1000)
    dead = root / ".xgen-staging/deadbeef/gguf/gone"
    dead.mkdir(parents=True)
    (dead / "m.gguf.0011.xgen-part").write_bytes(b"y" * 1000)
    live = root / ".xgen-staging/cafe/gguf/busy"
    live.mkdir(parents=True)
    (live / "m.gguf.2233.xgen-part").write_bytes(b"z")
    PrefixLock.objects.create(prefix="gguf/busy", holder=locks.process_holder("cli"))  # this process: alive
    removed = writes.sweep_store(store=store)
    assert sorted(removed) == [".xgen-staging/deadbeef", "gguf/kept/big.gguf.1a2b3c4d.xgen-part"]
    assert not (root / ".xgen-staging/deadbeef").exists() and (live / "m.gguf.2233.xgen-part").exists()
    assert store.read_manifest("gguf/kept") is not None  # the model itself is untouched
    assert sorted(p.name for p in (root / "gguf/kept").iterdir()) == [".xgen-manifest.json", "k.gguf"]


def test_delete_removes_part_files_too(hub_dirs):
    store = FilesystemModelStore(hub_dirs / "store")
    store.upload_model("gguf/old", make_model_dir(hub_dirs / "src", {"o.gguf": b"GGUF"}))
    (hub_dirs / "store/gguf/old/o.gguf.99.xgen-part").write_bytes(b"p" * 307)
    writes.delete_model(prefix="gguf/old", store=store)
    assert not (hub_dirs / "store/gguf/old").exists()


def test_incomplete_multipart_uploads_are_aborted_at_start_and_by_delete(hub_dirs, s3):
    store = minio_store_for(s3)
    store.upload_model("gguf/m", make_model_dir(hub_dirs / "src", {"m.gguf": b"GGUF"}))
    client = store.client
    # A kill -9 in the middle of a 64 MiB part: begun, one part sent, never completed.
    for key in ("gguf/m/big.gguf", ".xgen-staging/0123/gguf/other/big.gguf"):
        upload_id = client._create_multipart_upload(store.bucket, key, {})
        client._upload_part(store.bucket, key, b"x" * 5 * 2**20, None, upload_id, 1)
    assert len(store.incomplete_uploads("")) == 2
    removed = writes.sweep_store(store=store)
    assert sorted(removed) == [".xgen-staging/0123/gguf/other/big.gguf (incomplete upload)",
                               "gguf/m/big.gguf (incomplete upload)"]
    assert store.incomplete_uploads("") == []
    upload_id = client._create_multipart_upload(store.bucket, "gguf/m/again.gguf", {})
    writes.delete_model(prefix="gguf/m", store=store)
    assert store.incomplete_uploads("") == [] and store.scan_models() == []


# ---------------------------------------------------------------- #14 free space
@pytest.fixture
def small_store(hub_dirs, settings):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = hub_dirs / "small-store"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True)
    settings.STORE_DIR = mount
    yield FilesystemModelStore(mount)
    subprocess.run(["umount", str(mount)], check=True)


def test_a_sparse_file_larger_than_the_store_disk_is_refused_before_a_byte(small_store, hub_dirs):
    src = hub_dirs / "src"
    src.mkdir()
    with open(src / "sparse.gguf", "wb") as fh:  # 1 GiB apparent, a few KB on disk
        fh.truncate(2**30)
    with pytest.raises(StoreFull, match=r"not enough free space in the store for gguf/sparse: 1024\.0 MiB to write"):
        writes.write_model("gguf/sparse", src, store=small_store)
    assert [p for p in small_store.root.rglob("*") if p.is_file()] == []


def test_a_store_disk_that_fills_up_during_a_write_stops_it_cleanly(small_store, hub_dirs):
    small_store.upload_model("gguf/m", make_model_dir(hub_dirs / "v1", {"a.gguf": b"GGUF" * 100}))
    before = small_store.read_manifest("gguf/m")
    src = make_model_dir(hub_dirs / "v2", {"a.gguf": os.urandom(700_000), "b.gguf": os.urandom(700_000)})
    filler = small_store.root / "someone-else"

    def another_writer(done: int, total: int) -> None:  # takes the disk's space once a.gguf is in
        if done >= 700_000 and not filler.exists():
            filler.write_bytes(b"f" * 900_000)

    with pytest.raises(StoreFull, match="not enough free space in the store for gguf/m"):
        writes.write_model("gguf/m", src, store=small_store, replace=True, progress=another_writer)
    assert small_store.read_manifest("gguf/m") == before  # the old model is as it was
    assert not any(p.is_file() for p in (small_store.root / ".xgen-staging").rglob("*"))  # nothing left of v2
    assert not list(small_store.root.rglob("*.xgen-part"))


def test_an_upload_of_a_huge_folder_is_refused_without_walking_it(settings, hub_dirs, operator):
    imports = hub_dirs / "imports"
    folder = make_model_dir(imports / "tree", {"m.gguf": b"GGUF"})
    for i in range(UPLOAD_SCAN_MAX_ENTRIES + 5):
        (folder / f"f{i:05d}.txt").touch()
    settings.IMPORT_DIRS = [imports]
    resp = _upload(operator.key, folder)
    assert resp.status_code == 400, resp.content
    assert f"more than {UPLOAD_SCAN_MAX_ENTRIES} files and folders" in resp.json()["error"]["message"]
    assert not UploadJob.objects.exists()
