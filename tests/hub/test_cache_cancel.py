"""A sync into the node cache stops when its caller cancels it (an unload during CACHING): at the
next chunk, with no *.part file and nothing that passes as complete; a later sync finishes it."""
from __future__ import annotations

import threading

import pytest

from hub.cache import LOCAL_MANIFEST, SyncCancelled, sync_to_cache
from tests.hub.conftest import make_model_dir

pytestmark = pytest.mark.django_db(transaction=True)

PREFIX = "huggingface/cancel-test"
FILES = {f"shard-{i}.bin": bytes([i]) * (3 * 1024 * 1024) for i in range(4)} | {"config.json": b"{}"}


def test_a_cancelled_sync_stops_and_leaves_no_partial_file(hub_dirs, tmp_path, settings):
    from hub.models import CacheEntry
    from hub.store import FilesystemModelStore

    settings.CACHE_SYNC_WORKERS = 2
    store = FilesystemModelStore(hub_dirs / "store")
    store.upload_model(PREFIX, make_model_dir(tmp_path / "src", FILES))
    cancel = threading.Event()
    seen: list[int] = []

    def progress(done: int, total: int) -> None:
        seen.append(done)
        if done >= 2 * 1024 * 1024:  # a few MiB in: the instance is unloaded
            cancel.set()

    with pytest.raises(SyncCancelled):
        sync_to_cache(PREFIX, node_name="n1", store=store, progress=progress, cancel=cancel)
    local = settings.MODELS_DIR / PREFIX
    assert not list(local.rglob("*.part")) and not (local / LOCAL_MANIFEST).exists()
    assert max(seen) < sum(len(v) for v in FILES.values()), "the copy stopped before the end"
    assert not CacheEntry.objects.filter(prefix=PREFIX, state="READY").exists()
    # Cancelled before it starts: nothing is read.
    with pytest.raises(SyncCancelled):
        sync_to_cache(PREFIX, node_name="n1", store=store, cancel=cancel)
    done = sync_to_cache(PREFIX, node_name="n1", store=store, cancel=threading.Event())
    assert all((done / name).read_bytes() == data for name, data in FILES.items())
