"""The node cache on a full disk (a real 1 MiB tmpfs, mounted as root): a clear error, and no
`*.part` file or half-copied model left behind."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.hub.conftest import make_model_dir

pytestmark = pytest.mark.django_db

if os.geteuid() != 0:  # CI runs as root; mounting needs it
    pytest.skip("mounting a tmpfs needs root", allow_module_level=True)


@pytest.fixture
def small_disk(tmp_path: Path, settings):
    mount = tmp_path / "small-disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    settings.MODELS_DIR = mount / "models"
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def fs_store(tmp_path: Path, settings):
    from hub.store import FilesystemModelStore

    settings.STORE_DIR = tmp_path / "store"
    settings.MINIO_ENDPOINT = ""
    return FilesystemModelStore(tmp_path / "store")


def _leftovers(root: Path) -> list[Path]:
    """Files under root, except the per-model lock files (kept on purpose, empty)."""
    return [p for p in root.rglob("*") if p.is_file() and ".locks" not in p.parts]


def test_a_model_larger_than_the_disk_is_refused_before_any_transfer(small_disk, fs_store, tmp_path):
    from hardware.services import register_node
    from hub.cache import CacheFull, sync_to_cache
    from hub.models import CacheEntry

    register_node(name="n1", address="127.0.0.1")
    fs_store.upload_model("gguf/big", make_model_dir(tmp_path / "src", {"big.gguf": os.urandom(2 * 2**20)}))
    with pytest.raises(CacheFull, match=r"not enough disk space to cache gguf/big: needs 2\.0 MiB, 1\.0 MiB free"):
        sync_to_cache("gguf/big", node_name="n1", store=fs_store)
    assert _leftovers(small_disk) == []
    entry = CacheEntry.objects.get(prefix="gguf/big")
    assert entry.state == "FAILED" and "not enough disk space" in entry.error


def test_a_disk_that_fills_up_mid_copy_leaves_no_part_files(small_disk, fs_store, tmp_path):
    from hub.cache import CacheFull, sync_to_cache

    files = {f"shard-{i}.gguf": os.urandom(300 * 1024) for i in range(3)}
    fs_store.upload_model("gguf/sharded", make_model_dir(tmp_path / "src", files))
    filler = small_disk / "filler"

    def fill_the_disk(done: int, total: int) -> None:
        # Something else on the node takes the rest of the disk once copying has begun.
        if 0 < done < total and not filler.exists():
            with open(filler, "wb") as fh:
                try:
                    fh.write(b"\0" * 2**20)
                except OSError:
                    pass

    with pytest.raises(CacheFull, match="the cache disk filled up while copying gguf/sharded"):
        sync_to_cache("gguf/sharded", node_name="n1", store=fs_store, progress=fill_the_disk)
    left = [p for p in _leftovers(small_disk) if p != filler]
    assert not [p for p in left if p.name.endswith(".part")], left
    assert not (small_disk / "models" / "gguf" / "sharded" / ".xgen-cache.json").exists()
    # Room again: the next sync completes and verifies.
    filler.unlink()
    local = sync_to_cache("gguf/sharded", node_name="n1", store=fs_store)
    assert sorted(p.name for p in local.glob("*.gguf")) == sorted(files)
    assert all((local / name).read_bytes() == data for name, data in files.items())
