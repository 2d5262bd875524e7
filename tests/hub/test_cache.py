"""The node cache against the real S3 endpoint, with every request counted at a proxy."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from hub.cache import (
    LOCAL_MANIFEST,
    ModelNotInStore,
    cache_dir_for,
    is_cached,
    last_sync_stats,
    resolve_model_path,
    sync_to_cache,
)
from hub.paths import MANIFEST_NAME, InvalidPrefix
from tests.hub.conftest import make_model_dir, minio_store_for
from tests.procs import PYTHON

REPO = Path(__file__).resolve().parents[2]
FILES = {f"shard-{i}.bin": os.urandom(700_000 + i) for i in range(6)} | {"config.json": b'{"model_type": "x"}'}
PREFIX = "huggingface/cache-test"
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def counted(counting_s3, hub_dirs, tmp_path):
    """A MinIO store whose every request passes through the counting proxy, with one model in it."""
    store = minio_store_for(counting_s3.endpoint)
    store.upload_model(PREFIX, make_model_dir(tmp_path / "src", FILES))
    counting_s3.reset()
    return store, counting_s3


def _file_gets(proxy) -> int:
    return sum(proxy.gets(f"/{name}") for name in FILES)


def _assert_nothing_passes_as_complete(local_dir: Path) -> None:
    assert not (local_dir / LOCAL_MANIFEST).exists()
    for path in local_dir.rglob("*"):
        if path.is_file() and path.name in FILES:  # a final name must hold the full, verified bytes
            assert path.read_bytes() == FILES[path.name], f"{path.name} is partial under its final name"


def test_second_sync_transfers_nothing(counted, settings):
    store, proxy = counted
    seen = []
    local = sync_to_cache(PREFIX, node_name="n1", store=store, progress=lambda d, t: seen.append((d, t)))
    assert local == settings.MODELS_DIR.resolve() / PREFIX
    for name, data in FILES.items():
        assert (local / name).read_bytes() == data
    assert _file_gets(proxy) == len(FILES)
    assert proxy.counts.get(("HEAD", f"/xgen-test-models/{PREFIX}/shard-0.bin"), 0) == 0  # one GET per file, no HEAD
    total = sum(map(len, FILES.values()))
    assert seen[-1] == (total, total) and seen == sorted(seen)
    proxy.reset()
    sync_to_cache(PREFIX, node_name="n1", store=store)
    assert _file_gets(proxy) == 0
    assert sum(proxy.counts.values()) == 1  # the store manifest, nothing else
    assert last_sync_stats[PREFIX].files_fetched == 0
    assert is_cached(PREFIX, store=store)


def test_truncated_or_corrupted_files_are_fetched_again(counted):
    store, proxy = counted
    local = sync_to_cache(PREFIX, node_name="n1", store=store)
    with open(local / "shard-1.bin", "r+b") as fh:
        fh.truncate(1000)
    data = bytearray((local / "shard-2.bin").read_bytes())
    data[500] ^= 0xFF
    (local / "shard-2.bin").write_bytes(bytes(data))  # same size, other bytes
    assert not is_cached(PREFIX, store=store)
    proxy.reset()
    sync_to_cache(PREFIX, node_name="n1", store=store)
    assert proxy.gets("/shard-1.bin") == 1 and proxy.gets("/shard-2.bin") == 1
    assert _file_gets(proxy) == 2
    assert (local / "shard-1.bin").read_bytes() == FILES["shard-1.bin"]
    assert (local / "shard-2.bin").read_bytes() == FILES["shard-2.bin"]


def test_a_corruption_that_hides_its_mtime_is_caught_by_verify(counted):
    store, proxy = counted
    local = sync_to_cache(PREFIX, node_name="n1", store=store)
    target = local / "shard-3.bin"
    st = target.stat()
    data = bytearray(target.read_bytes())
    data[0] ^= 0xFF
    target.write_bytes(bytes(data))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    proxy.reset()
    sync_to_cache(PREFIX, node_name="n1", store=store, verify=True)
    assert _file_gets(proxy) == 1 and target.read_bytes() == FILES["shard-3.bin"]


def test_an_exception_mid_transfer_leaves_nothing_that_passes_as_complete(counted):
    store, proxy = counted

    def explode(done, total):
        if done > 1_500_000:
            raise RuntimeError("network cable cut")

    with pytest.raises(RuntimeError, match="network cable cut"):
        sync_to_cache(PREFIX, node_name="n1", store=store, progress=explode)
    local = cache_dir_for(PREFIX)
    _assert_nothing_passes_as_complete(local)
    assert not list(local.rglob("*.part"))
    assert not is_cached(PREFIX, store=store)
    proxy.reset()
    sync_to_cache(PREFIX, node_name="n1", store=store)
    assert is_cached(PREFIX, store=store)
    assert _file_gets(proxy) <= len(FILES)


def test_a_sync_killed_half_way_leaves_nothing_that_passes_as_complete(counted, settings):
    store, proxy = counted
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "xgenconsole.settings",
           "XGEN_DATA_DIR": str(settings.MODELS_DIR.parent / "child-data"),
           "XGEN_MODELS_DIR": str(settings.MODELS_DIR), "MINIO_ENDPOINT": proxy.endpoint,
           "MINIO_ACCESS_KEY": "testing-access", "MINIO_SECRET_KEY": "testing-secret-key",
           "MINIO_BUCKET": "xgen-test-models", "XGEN_CACHE_SYNC_WORKERS": "2"}
    proc = subprocess.Popen([PYTHON, "-m", "tests.hub.sync_child", PREFIX, "0.3"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    total = sum(map(len, FILES.values()))
    try:
        for line in proc.stdout:
            if line.startswith("progress"):
                done = int(line.split()[1])
                if 0 < done < total:
                    break
        else:
            pytest.fail("the child finished or died before it was half-way")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=10)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    local = cache_dir_for(PREFIX)
    _assert_nothing_passes_as_complete(local)
    assert not is_cached(PREFIX, store=store)
    # The next sync cleans up what the killed one left and completes.
    sync_to_cache(PREFIX, node_name="n1", store=store)
    assert is_cached(PREFIX, store=store) and not list(local.rglob("*.part"))
    for name, data in FILES.items():
        assert (local / name).read_bytes() == data


def test_two_concurrent_syncs_transfer_once(counted):
    store, proxy = counted
    other = minio_store_for(proxy.endpoint)  # a second client, as a second caller would have
    barrier = threading.Barrier(2)
    results, errors = [], []

    def run(s):
        try:
            barrier.wait()
            results.append(sync_to_cache(PREFIX, node_name="n1", store=s))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in (store, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 2 and results[0] == results[1]
    for name in FILES:
        assert proxy.gets(f"/{PREFIX}/{name}") == 1, name


def test_a_sync_in_another_process_and_one_here_transfer_once(counted, settings):
    store, proxy = counted
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "xgenconsole.settings",
           "XGEN_DATA_DIR": str(settings.MODELS_DIR.parent / "child-data"),
           "XGEN_MODELS_DIR": str(settings.MODELS_DIR), "MINIO_ENDPOINT": proxy.endpoint,
           "MINIO_ACCESS_KEY": "testing-access", "MINIO_SECRET_KEY": "testing-secret-key",
           "MINIO_BUCKET": "xgen-test-models", "XGEN_CACHE_SYNC_WORKERS": "2"}
    proc = subprocess.Popen([PYTHON, "-m", "tests.hub.sync_child", PREFIX, "0.05"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # the child holds the model lock once bytes flow
            if line.startswith("progress") and int(line.split()[1]) > 0:
                break
        local = sync_to_cache(PREFIX, node_name="n1", store=store)  # waits for the child's lock
        out = proc.stdout.read()
    finally:
        proc.wait(timeout=30)
        proc.stdout.close()
    assert proc.returncode == 0 and "done" in out
    assert last_sync_stats[PREFIX].files_fetched == 0
    for name, data in FILES.items():
        assert proxy.gets(f"/{PREFIX}/{name}") == 1, name
        assert (local / name).read_bytes() == data


def test_a_verified_copy_loads_while_the_store_is_down(counted):
    from hub.store import StoreError

    store, proxy = counted
    local = sync_to_cache(PREFIX, node_name="n1", store=store)
    proxy.dead = True
    assert sync_to_cache(PREFIX, node_name="n1", store=store) == local
    with open(local / "shard-0.bin", "r+b") as fh:  # a damaged copy is not trusted offline
        fh.truncate(10)
    with pytest.raises(StoreError):
        sync_to_cache(PREFIX, node_name="n1", store=store)


def test_an_object_replaced_after_its_manifest_is_refused(counted):
    from hub.cache import CacheCorrupt

    store, _ = counted
    store.put_bytes(f"{PREFIX}/shard-4.bin", os.urandom(len(FILES["shard-4.bin"])))  # same size, other bytes
    with pytest.raises(CacheCorrupt, match="changed in the store"):
        sync_to_cache(PREFIX, node_name="n1", store=store)
    _assert_nothing_passes_as_complete(cache_dir_for(PREFIX))


def test_verify_hashes_every_fetched_byte(counted):
    store, _ = counted
    local = sync_to_cache(PREFIX, node_name="n1", store=store, verify=True)
    assert (local / "shard-5.bin").read_bytes() == FILES["shard-5.bin"]


def test_a_model_without_manifest_is_never_synced(counted):
    store, _ = counted
    store.put_bytes("gguf/partial/a.gguf", b"x")
    with pytest.raises(ModelNotInStore):
        sync_to_cache("gguf/partial", node_name="n1", store=store)


def test_a_manifest_pointing_outside_the_model_is_refused(counted):
    store, _ = counted
    store.put_bytes(f"gguf/evil/{MANIFEST_NAME}",
                    b'{"prefix": "gguf/evil", "format": "gguf", "files": [{"path": "../../x", "size": 1}]}')
    with pytest.raises(ModelNotInStore):  # an unreadable manifest means the model is not complete
        sync_to_cache("gguf/evil", node_name="n1", store=store)
    assert not (cache_dir_for("gguf/evil").parent.parent / "x").exists()


@pytest.mark.parametrize("bad", ["../x", "gguf/../../etc", "/abs", "gguf/a\\b"])
def test_traversal_is_refused_before_any_request(counted, bad):
    store, proxy = counted
    with pytest.raises(InvalidPrefix):
        sync_to_cache(bad, node_name="n1", store=store)
    assert sum(proxy.counts.values()) == 0


def test_cache_entries_follow_the_sync(counted):
    from hardware.models import Node
    from hub.models import CacheEntry

    store, _ = counted
    node = Node.objects.create(name="n1", address="127.0.0.1")
    sync_to_cache(PREFIX, node_name="n1", store=store)
    entry = CacheEntry.objects.get(node=node, prefix=PREFIX)
    total = sum(map(len, FILES.values()))
    assert (entry.state, entry.bytes_done, entry.bytes_total) == ("READY", total, total)


def test_filesystem_store_syncs_too(hub_dirs, tmp_path):
    from hub.store import FilesystemModelStore

    store = FilesystemModelStore(hub_dirs / "store")
    store.upload_model(PREFIX, make_model_dir(tmp_path / "src", FILES))
    local = sync_to_cache(PREFIX, node_name="n1", store=store)
    assert hashlib.sha256((local / "shard-0.bin").read_bytes()).digest() == hashlib.sha256(FILES["shard-0.bin"]).digest()
    assert last_sync_stats[PREFIX].files_fetched == len(FILES)
    sync_to_cache(PREFIX, node_name="n1", store=store)
    assert last_sync_stats[PREFIX].files_fetched == 0


def test_resolve_model_path(tmp_path):
    g = make_model_dir(tmp_path / "g", {"small.gguf": b"s", "big.gguf": b"b" * 10, "README.md": b"r"})
    assert resolve_model_path(g, "gguf") == g / "big.gguf"
    assert resolve_model_path(g, "gguf", "small.gguf") == (g / "small.gguf").resolve()
    with pytest.raises(InvalidPrefix):
        resolve_model_path(g, "gguf", "../g/small.gguf")
    split = make_model_dir(tmp_path / "s", {"m-00001-of-00002.gguf": b"a", "m-00002-of-00002.gguf": b"b" * 9})
    assert resolve_model_path(split, "gguf") == split / "m-00001-of-00002.gguf"
    h = make_model_dir(tmp_path / "h", {"snap/config.json": b"{}", "snap/model.safetensors": b"w"})
    assert resolve_model_path(h, "huggingface") == h / "snap"
    flat = make_model_dir(tmp_path / "f", {"config.json": b"{}"})
    assert resolve_model_path(flat, "huggingface") == flat


def test_big_files_go_up_in_parts_and_come_back_verified(s3, hub_dirs, tmp_path):
    store = minio_store_for(s3)
    big = tmp_path / "big" / "model.gguf"
    big.parent.mkdir()
    with open(big, "wb") as fh:
        for i in range(70):
            fh.write(bytes([i]) * 2**20)
    seen = []
    manifest = store.upload_model("gguf/big", big, progress=lambda d, t: seen.append(d))
    [entry] = manifest.files
    assert entry.etag.endswith("-2")  # multipart: 64 MiB parts (a new model is written in place on S3)
    assert len(seen) >= 9 and seen[-1] == 70 * 2**20  # progress within each part
    local = sync_to_cache("gguf/big", node_name="n1", store=store)
    assert hashlib.sha256((local / "model.gguf").read_bytes()).hexdigest() == entry.sha256
    assert resolve_model_path(local, "gguf") == local / "model.gguf"
