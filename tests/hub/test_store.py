"""One contract suite, run against both stores (the MinIO one through the minio SDK on the real
S3 endpoint)."""
from __future__ import annotations

import hashlib
import os
import socket
import threading

import pytest

from hub.paths import MANIFEST_NAME, InvalidPrefix
from hub.store import (
    FilesystemModelStore,
    MinioModelStore,
    NotARegularFile,
    ObjectMissing,
    StoreError,
    get_store,
    local_files,
)
from tests.hub.conftest import make_model_dir

FILES = {"config.json": b'{"a": 1}', "model.safetensors": b"\x01" * 300_000, "sub/tokenizer.json": b"{}"}


def test_upload_writes_every_file_then_the_manifest(store, tmp_path):
    src = make_model_dir(tmp_path / "src", {**FILES, ".cache/huggingface/x.lock": b"no"})
    seen = []
    manifest = store.upload_model("huggingface/m1", src, source={"repo_id": "o/m1"},
                                  progress=lambda d, t: seen.append((d, t)))
    assert sorted(f.path for f in manifest.files) == sorted(FILES)
    for f in manifest.files:
        assert f.sha256 == hashlib.sha256(FILES[f.path]).hexdigest()
        assert f.size == len(FILES[f.path]) and f.etag
    assert seen[-1] == (sum(map(len, FILES.values())),) * 2
    again = store.read_manifest("huggingface/m1")
    assert again.files == manifest.files and again.source == {"repo_id": "o/m1"}
    assert sorted(o.key for o in store.list_files("huggingface/m1")) == sorted(f"huggingface/m1/{p}" for p in FILES)
    [model] = store.scan_models()
    assert (model.prefix, model.format, model.complete) == ("huggingface/m1", "huggingface", True)
    assert model.file_count == 3 and model.size_bytes == sum(map(len, FILES.values()))


def test_a_single_file_uploads_under_its_name(store, tiny_gguf):
    manifest = store.upload_model("gguf/tiny", tiny_gguf)
    assert [f.path for f in manifest.files] == [tiny_gguf.name]


def test_objects_without_a_manifest_are_incomplete(store):
    store.put_bytes("gguf/half/model.gguf", b"x" * 10)
    [model] = store.scan_models()
    assert model.prefix == "gguf/half" and not model.complete and model.file_count == 1
    assert store.read_manifest("gguf/half") is None and not store.exists("gguf/half")


def test_an_interrupted_upload_never_looks_like_a_model(store, tmp_path):
    src = make_model_dir(tmp_path / "src", FILES)
    store.upload_model("huggingface/m2", src)

    def boom(done, total):
        if done > 100_000:
            raise RuntimeError("disk unplugged")

    before = store.read_manifest("huggingface/m2")
    with pytest.raises(RuntimeError, match="disk unplugged"):
        store.upload_model("huggingface/m2", src, progress=boom, replace=True)
    # The new version was written beside the old one (issue 34 #10): the old one is untouched.
    assert store.read_manifest("huggingface/m2") == before
    assert store.scan_models()[0].complete
    assert list(store.iter_objects(".xgen-staging/")) == []
    with pytest.raises(RuntimeError, match="disk unplugged"):  # a first upload that fails leaves nothing
        store.upload_model("huggingface/m9", src, progress=boom)
    assert [m.prefix for m in store.scan_models()] == ["huggingface/m2"]


def _in_thread(fn, timeout: float = 10.0):
    """fn() in a thread: its result or exception, or a failure (not a hang) if it blocks."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return t.is_alive(), out


@pytest.mark.parametrize("special", ["fifo", "socket", "symlink-to-fifo"])
def test_a_folder_with_a_special_file_is_refused_before_anything_is_written(store, tmp_path, special):
    src = make_model_dir(tmp_path / "src", FILES)
    store.upload_model("huggingface/m6", src)
    before = store.read_manifest("huggingface/m6")
    sock = None
    if special == "fifo":
        os.mkfifo(src / "sub" / "pipe")
    elif special == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(src / "sub" / "sock"))
    else:
        os.mkfifo(tmp_path / "pipe")
        (src / "pipe.json").symlink_to(tmp_path / "pipe")
    try:
        hung, out = _in_thread(lambda: store.upload_model("huggingface/m6", src))
        if hung:  # release the reader stuck on the FIFO before failing
            for fifo in (src / "sub" / "pipe", tmp_path / "pipe"):
                if fifo.exists():
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        assert not hung, "the upload blocked on a special file"
        assert isinstance(out.get("error"), NotARegularFile), out
        assert "not a regular file" in str(out["error"])
        # Refused before anything was written: the previous complete version is untouched.
        assert store.read_manifest("huggingface/m6") == before
    finally:
        if sock is not None:
            sock.close()


def test_a_file_replaced_after_its_walk_is_not_uploaded(store, tmp_path):
    src = make_model_dir(tmp_path / "src", FILES)
    files = local_files(src)
    other = tmp_path / "other"
    other.write_bytes(b"not the checked file")
    os.replace(other, src / "config.json")
    with pytest.raises(NotARegularFile, match="replaced after it was checked"):
        store.upload_model("huggingface/m7", src, files=files)
    assert store.read_manifest("huggingface/m7") is None


def test_a_cancelled_upload_stops_and_stays_incomplete(store, tmp_path):
    src = make_model_dir(tmp_path / "src", FILES)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(StoreError):
        store.upload_model("huggingface/m3", src, cancel=cancel)
    assert store.read_manifest("huggingface/m3") is None


def test_reupload_replaces_files_and_drops_stale_ones(store, tmp_path):
    store.upload_model("huggingface/m4", make_model_dir(tmp_path / "v1", FILES))
    v2 = make_model_dir(tmp_path / "v2", {"config.json": b'{"a": 2}', "weights.bin": b"w" * 10})
    manifest = store.upload_model("huggingface/m4", v2, replace=True)
    assert {f.path for f in manifest.files} == {"config.json", "weights.bin"}
    assert {o.key for o in store.list_files("huggingface/m4")} == {"huggingface/m4/config.json",
                                                                   "huggingface/m4/weights.bin"}


def test_delete_removes_the_manifest_and_every_object(store, tmp_path):
    store.upload_model("huggingface/m5", make_model_dir(tmp_path / "src", FILES))
    store.upload_model("gguf/keep", make_model_dir(tmp_path / "k", {"k.gguf": b"k"}))
    assert store.delete_model("huggingface/m5") == 3
    assert [m.prefix for m in store.scan_models()] == ["gguf/keep"]


def test_streams_and_small_objects(store, tmp_path):
    store.put_bytes("gguf/s/a.gguf", b"hello world")
    assert store.get_bytes("gguf/s/a.gguf") == b"hello world"
    chunks = []
    with open(tmp_path / "out", "wb") as fh:
        etag = store.stream_to("gguf/s/a.gguf", fh, on_chunk=chunks.append)
    assert (tmp_path / "out").read_bytes() == b"hello world" and b"".join(chunks) == b"hello world" and etag
    with pytest.raises(ObjectMissing):
        store.get_bytes("gguf/s/missing")
    # A ranged read of an object's start (a GGUF's header): the bytes asked for, all of a shorter one.
    assert store.get_head("gguf/s/a.gguf", 5) == b"hello"
    assert store.get_head("gguf/s/a.gguf", 1 << 20) == b"hello world"
    with pytest.raises(ObjectMissing):
        store.get_head("gguf/s/missing", 5)
    with pytest.raises(ObjectMissing), open(tmp_path / "o2", "wb") as fh:
        store.stream_to("gguf/s/missing", fh, on_chunk=chunks.append)


@pytest.mark.parametrize("bad", ["../x", "gguf/../../etc", "/etc", "gguf//a", "other/x"])
def test_every_model_operation_refuses_traversal(store, tmp_path, bad):
    src = make_model_dir(tmp_path / "src", {"a": b"a"})
    for call in (lambda: store.upload_model(bad, src), lambda: store.read_manifest(bad),
                 lambda: store.delete_model(bad), lambda: store.list_files(bad)):
        with pytest.raises(InvalidPrefix):
            call()


def test_listing_pages_through_many_models(store):
    # 600 models with two objects each: 1,200 keys, past S3's 1,000-key listing page.
    for i in range(600):
        store.put_bytes(f"gguf/m{i:04d}/w.gguf", b"w")
        if i % 2 == 0:
            store.put_bytes(f"gguf/m{i:04d}/{MANIFEST_NAME}", b"{}")
    models = store.scan_models()
    assert len(models) == 600
    assert sum(m.complete for m in models) == 300
    assert models[0].prefix == "gguf/m0000" and models[-1].prefix == "gguf/m0599"


def test_get_store_follows_settings(settings, s3, hub_dirs):
    assert isinstance(get_store(), FilesystemModelStore)
    settings.MINIO_ENDPOINT = s3.endpoint
    settings.MINIO_ACCESS_KEY, settings.MINIO_SECRET_KEY = s3.access_key, s3.secret_key
    settings.MINIO_BUCKET = "fresh-bucket"
    store = get_store()
    assert isinstance(store, MinioModelStore)
    assert not s3.client().bucket_exists("fresh-bucket")
    assert store.scan_models() == []
    assert s3.client().bucket_exists("fresh-bucket")  # created when missing


def test_a_complete_model_is_overwritten_only_when_asked(store, tmp_path):
    from hub.store import ModelExists

    store.upload_model("gguf/kept", make_model_dir(tmp_path / "v1", {"model.gguf": b"v1" * 100}))
    before = store.read_manifest("gguf/kept")
    with pytest.raises(ModelExists, match="already a complete model"):
        store.upload_model("gguf/kept", make_model_dir(tmp_path / "v2", {"model.gguf": b"v2" * 50}))
    assert store.read_manifest("gguf/kept") == before  # nothing was written
    assert store.get_bytes("gguf/kept/model.gguf") == b"v1" * 100
    assert store.upload_model("gguf/kept", tmp_path / "v2", replace=True).size_bytes == 100


def test_two_uploads_to_one_name_never_make_a_broken_model(store, tmp_path, settings):
    """Issue 17 #5 at the store: X (a-first.gguf, then a slow z-big.gguf) and, while X is on z-big,
    Y (m-other.gguf) to the same name, with no lock around them. Y's clean-up removes a-first.gguf;
    X must then not write a manifest that lists it: whatever manifest is left loads."""
    from hub.cache import resolve_model_path, sync_to_cache
    from hub.store import ConcurrentWrite

    x = make_model_dir(tmp_path / "x", {"a-first.gguf": b"a" * 100_000, "z-big.gguf": os.urandom(3 * 2**20)})
    y = make_model_dir(tmp_path / "y", {"m-other.gguf": b"m" * 200_000})
    on_big, y_done = threading.Event(), threading.Event()

    def slow(done: int, total: int) -> None:
        if done > 100_000 and not y_done.is_set():  # X is reading z-big.gguf: let Y run meanwhile
            on_big.set()
            y_done.wait(30)

    x_errors: list[Exception] = []

    def upload_x() -> None:
        try:
            store.upload_model("gguf/race", x, progress=slow)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            x_errors.append(exc)

    t = threading.Thread(target=upload_x, daemon=True)
    t.start()
    assert on_big.wait(30), "X never reached its second file"
    store.upload_model("gguf/race", y)  # nothing complete there yet: no replace needed
    y_done.set()
    t.join(60)
    assert not t.is_alive()
    assert len(x_errors) == 1 and isinstance(x_errors[0], ConcurrentWrite), x_errors  # X wrote no manifest
    manifest = store.read_manifest("gguf/race")
    listed = {o.key: o.size for o in store.list_files("gguf/race")}
    assert [f.path for f in manifest.files] == ["m-other.gguf"]
    assert all(listed.get(f"gguf/race/{f.path}") == f.size for f in manifest.files), (manifest.files, listed)
    local = sync_to_cache("gguf/race", node_name="n1", store=store)  # "load" it: the copy checks out
    assert resolve_model_path(local, "gguf").name == "m-other.gguf"
