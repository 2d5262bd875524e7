"""The node cache: a verified local copy of a store model under MODELS_DIR/<prefix>.

sync_to_cache() fetches only what differs from the store's manifest, into `*.part` files that
are renamed into place after their size and sha256 check out, several files at once. A
per-model file lock (fcntl) makes concurrent syncs, in threads or processes, transfer once.
A local manifest written after a verified sync lets the next call confirm "already cached"
with one small GET (the store manifest) instead of a request per file.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from hub import layout
from hub.layout import CACHE_MANIFEST_NAME, MANIFEST_NAME
from hub.paths import InvalidPrefix, safe_join, validate_prefix
from hub.store import Manifest, ManifestFile, ModelStore, StoreError, get_store
from live.db import run_db_sync

log = logging.getLogger("xgen.hub.cache")

LOCAL_MANIFEST = CACHE_MANIFEST_NAME
PART = ".part"
Progress = Callable[[int, int], None]


class CacheError(RuntimeError):
    """The model could not be made available in the cache."""


class ModelNotInStore(CacheError):
    """The prefix has no complete model (no manifest) in the store."""


class CacheFull(CacheError):
    """Not enough disk space in the node cache for a model."""


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _check_room(local_dir: Path, prefix: str, need: int) -> None:
    """Refuse before transferring a byte when the files to fetch cannot fit on the disk."""
    free = _free_bytes(local_dir)
    if need > free:
        raise CacheFull(f"not enough disk space to cache {prefix}: needs {need / 2**20:.1f} MiB, "
                        f"{free / 2**20:.1f} MiB free in {local_dir.parent}")


class CacheCorrupt(CacheError):
    """A fetched file did not match the manifest (size or checksum)."""


class SyncCancelled(CacheError):
    """The caller cancelled the sync (an unload during the copy); no partial file is left."""


@dataclass
class SyncStats:
    """What the last sync of this process did (for tests and the bench)."""

    files_fetched: int = 0
    bytes_fetched: int = 0
    files_kept: int = 0
    evicted: list[str] = field(default_factory=list)  # unused models removed to stay under XGEN_CACHE_MAX_GB


last_sync_stats: dict[str, SyncStats] = {}

RoomKeeper = Callable[..., list[str]]
_room_keeper: RoomKeeper | None = None


def set_room_keeper(keeper: RoomKeeper) -> None:
    """hub.node_cache.make_room: `(need, node_name=, keep=)` evicts to stay under XGEN_CACHE_MAX_GB."""
    global _room_keeper
    _room_keeper = keeper


def cache_dir_for(prefix: str) -> Path:
    """MODELS_DIR/<prefix>, never outside MODELS_DIR."""
    return safe_join(settings.MODELS_DIR, validate_prefix(prefix))


def _lock_path(prefix: str) -> Path:
    lock_dir = Path(settings.MODELS_DIR) / ".locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    return lock_dir / (prefix.replace("/", "__") + ".lock")


@contextmanager
def model_lock(prefix: str):
    """Exclusive per-model lock across threads and processes (flock on its own open file)."""
    fh = open(_lock_path(prefix), "a+")  # noqa: SIM115
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        fh.close()


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(4 * 1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


def read_local_manifest(local_dir: Path) -> dict | None:
    """The record of the last verified sync, or None."""
    try:
        return json.loads((local_dir / LOCAL_MANIFEST).read_text())
    except (FileNotFoundError, ValueError, OSError):
        return None


def _file_unchanged(local_dir: Path, rec: dict) -> bool:
    """The file still has the size and mtime recorded when it was verified."""
    try:
        st = (local_dir / rec["path"]).stat()
    except (OSError, KeyError):
        return False
    return st.st_size == rec.get("size") and st.st_mtime_ns == rec.get("mtime_ns")


def _manifest_matches_local(manifest: Manifest, local: dict | None, local_dir: Path) -> bool:
    if not local or local.get("prefix") != manifest.prefix:
        return False
    recorded = {r["path"]: r for r in local.get("files", [])}
    if len(recorded) != len(manifest.files):
        return False
    for f in manifest.files:
        rec = recorded.get(f.path)
        if rec is None or rec.get("size") != f.size or rec.get("etag") != f.etag or rec.get("sha256") != f.sha256:
            return False
        if not _file_unchanged(local_dir, rec):
            return False
    return True


def _offline_copy(local_dir: Path, prefix: str) -> int | None:
    """Bytes of a complete local copy whose files still match their last verification, else None."""
    local = read_local_manifest(local_dir)
    if not local or local.get("prefix") != prefix or not local.get("files"):
        return None
    if not all(_file_unchanged(local_dir, rec) for rec in local["files"]):
        return None
    return sum(int(rec.get("size", 0)) for rec in local["files"])


def is_cached(prefix: str, *, store: ModelStore | None = None) -> bool:
    """True when the local copy matches the store's manifest (one small GET, no per-file requests)."""
    local_dir = cache_dir_for(prefix)
    manifest = (store or get_store()).read_manifest(prefix)
    return manifest is not None and _manifest_matches_local(manifest, read_local_manifest(local_dir), local_dir)


def _write_local_manifest(local_dir: Path, manifest: Manifest) -> None:
    files = []
    for f in manifest.files:
        st = (local_dir / f.path).stat()
        files.append({"path": f.path, "size": f.size, "etag": f.etag, "sha256": f.sha256, "mtime_ns": st.st_mtime_ns})
    body = {"prefix": manifest.prefix, "format": manifest.format, "synced_at": timezone.now().isoformat(),
            "size_bytes": manifest.size_bytes, "files": files}
    tmp = local_dir / (LOCAL_MANIFEST + PART)
    try:
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, local_dir / LOCAL_MANIFEST)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:  # the disk filled after the last file: the model is not cached
            raise _disk_full(local_dir, manifest.prefix) from exc
        raise


def _plan(manifest: Manifest, local_dir: Path, local: dict | None) -> tuple[list[ManifestFile], list[ManifestFile]]:
    """(files to fetch, files already good). A file of the right size whose record does not
    vouch for it (changed mtime, no record, other etag) is re-hashed before it is trusted."""
    recorded = {r["path"]: r for r in (local or {}).get("files", [])} if local and local.get("prefix") == manifest.prefix else {}
    fetch, keep = [], []
    for f in manifest.files:
        path = safe_join(local_dir, f.path)
        rec = recorded.get(f.path)
        try:
            size = path.stat().st_size
        except OSError:
            fetch.append(f)
            continue
        if size != f.size:
            fetch.append(f)
        elif rec and rec.get("etag") == f.etag and rec.get("sha256") == f.sha256 and _file_unchanged(local_dir, rec):
            keep.append(f)
        elif f.sha256 and _sha256_of(path) == f.sha256:
            keep.append(f)
        else:
            fetch.append(f)
    return fetch, keep


def _remove_strays(local_dir: Path, manifest: Manifest) -> None:
    """Delete files the manifest does not list (old versions, *.part leftovers of a killed sync)."""
    wanted = {f.path for f in manifest.files} | {LOCAL_MANIFEST}
    for dirpath, _dirnames, filenames in os.walk(local_dir):
        for name in filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(local_dir).as_posix()
            if rel not in wanted:
                path.unlink(missing_ok=True)


class _Cancelled(Exception):
    pass


def _fetch_file(store: ModelStore, prefix: str, f: ManifestFile, local_dir: Path, on_bytes: Callable[[int], None],
                stop: threading.Event, *, hash_bytes: bool) -> int:
    """Fetch one file to `<name>.part` and rename it into place only once it checks out:
    size, the store's ETag equal to the manifest's (the very object the manifest describes),
    and, when asked or when there is no ETag to compare, the sha256."""
    dest = safe_join(local_dir, f.path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + PART)
    hash_bytes = hash_bytes or not f.etag
    digest = hashlib.sha256() if hash_bytes else None
    written = 0
    if stop.is_set():  # cancelled or failed before this file's turn came
        raise _Cancelled()

    def on_chunk(chunk: bytes) -> None:
        nonlocal written
        if stop.is_set():
            raise _Cancelled()
        if digest is not None:
            digest.update(chunk)
        written += len(chunk)
        on_bytes(len(chunk))

    try:
        with open(part, "wb") as fh:
            etag = store.stream_to(f"{prefix}/{f.path}", fh, on_chunk=on_chunk)
        if written != f.size:
            raise CacheCorrupt(f"{prefix}/{f.path}: got {written} bytes, the manifest says {f.size}")
        if f.etag and etag and etag != f.etag:
            raise CacheCorrupt(f"{prefix}/{f.path} changed in the store after its manifest was written")
        if digest is not None and f.sha256 and digest.hexdigest() != f.sha256:
            raise CacheCorrupt(f"{prefix}/{f.path}: checksum differs from the manifest")
        os.replace(part, dest)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return written


def _cache_entry(node_name: str, prefix: str, **fields) -> None:
    """Record the node's cache state; a node not yet registered is simply not recorded."""
    from hardware.models import Node
    from hub.models import CacheEntry

    node = Node.objects.filter(name=node_name).first()
    if node is None:
        return
    now = timezone.now()
    if fields.get("state") == "READY":  # a sync that ends READY is a load using the copy (LRU order)
        fields["last_used_at"] = now
    CacheEntry.objects.update_or_create(node=node, prefix=prefix, defaults={**fields, "updated_at": now})


@dataclass
class _Sync:
    """One sync_to_cache call: the model, where it goes, and whom it tells (progress, cache row)."""

    prefix: str
    node_name: str
    store: ModelStore
    local_dir: Path
    verify: bool
    progress: Progress | None
    cancel: threading.Event | None
    stats: SyncStats = field(default_factory=SyncStats)
    done: int = 0  # bytes of the model on disk and checked, while it copies
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def report(self, done: int, total: int) -> None:
        if self.progress:
            self.progress(done, total)

    def add(self, n: int, total: int) -> None:
        """Bytes a fetch worker wrote (any thread)."""
        with self._lock:
            self.done += n
            self.report(self.done, total)

    def record(self, **fields) -> None:
        _safe_record(self.node_name, self.prefix, **fields)


def _disk_full(local_dir: Path, prefix: str) -> CacheFull:
    return CacheFull(f"the cache disk filled up while copying {prefix}: {_free_bytes(local_dir) / 2**20:.1f} MiB "
                     f"free in {local_dir.parent}; partial files were removed")


def _store_manifest(sync: _Sync) -> Manifest | None:
    """The store's manifest of the model, checked (it names this model, no path leaves its folder).
    None when the store is down but a copy verified earlier is untouched: that copy serves as is."""
    try:
        manifest = sync.store.read_manifest(sync.prefix)
    except StoreError:
        offline = _offline_copy(sync.local_dir, sync.prefix)
        if offline is None:
            raise
        log.warning("store %s unreachable; using the verified local copy of %s", sync.store.describe(), sync.prefix)
        sync.report(offline, offline)
        return None
    if manifest is None:
        raise ModelNotInStore(f"{sync.prefix} is not a complete model in the store ({sync.store.describe()}).")
    if manifest.prefix != sync.prefix:
        raise CacheError(f"the manifest of {sync.prefix} names {manifest.prefix}")
    for f in manifest.files:  # a manifest must not point outside the model folder
        safe_join(sync.local_dir, f.path)
    return manifest


def _already_cached(sync: _Sync, manifest: Manifest, local: dict | None) -> bool:
    """The local copy matches the manifest (not asked to verify): reported READY, nothing fetched."""
    if sync.verify or not _manifest_matches_local(manifest, local, sync.local_dir):
        return False
    total = manifest.size_bytes
    sync.stats.files_kept = len(manifest.files)
    sync.report(total, total)
    sync.record(state="READY", bytes_done=total, bytes_total=total, error="")
    return True


def _prepare_folder(sync: _Sync, manifest: Manifest, local: dict | None) -> tuple[list[ManifestFile], list[ManifestFile]]:
    """Under the model lock: the folder stops looking complete (its local manifest goes first),
    files the manifest does not list go, and what to fetch and keep is planned."""
    sync.local_dir.mkdir(parents=True, exist_ok=True)
    (sync.local_dir / LOCAL_MANIFEST).unlink(missing_ok=True)
    _remove_strays(sync.local_dir, manifest)
    return _plan(manifest, sync.local_dir, None if sync.verify else local)


def _ensure_room(sync: _Sync, fetch: list[ManifestFile], total: int) -> None:
    """XGEN_CACHE_MAX_GB (unused models evicted) and the disk's free space, before a byte moves."""
    need = sum(f.size for f in fetch)
    try:
        if _room_keeper is not None and fetch:
            sync.stats.evicted = run_db_sync(_room_keeper, need, node_name=sync.node_name, keep=sync.prefix)
        _check_room(sync.local_dir, sync.prefix, need)
    except CacheFull as exc:
        sync.record(state="FAILED", bytes_done=0, bytes_total=total, error=str(exc))
        raise


def _watch_fetches(sync: _Sync, futures: list, stop: threading.Event, total: int) -> bool:
    """Wait for the fetch workers, writing progress to the cache row each second; on the first
    error or a cancel every worker stops at its next chunk. Returns whether it was cancelled."""
    pending = set(futures)
    last_record = time.monotonic()
    while pending:
        finished, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
        if any(fut.exception() for fut in finished) or sync.cancelled():
            break
        if time.monotonic() - last_record > 1.0:
            sync.record(state="SYNCING", bytes_done=sync.done, bytes_total=total)
            last_record = time.monotonic()
    cancelled = sync.cancelled()
    stop.set()
    wait(futures)
    return cancelled


def _fetch_all(sync: _Sync, fetch: list[ManifestFile], total: int) -> None:
    """Fetch the files that differ, several at once; SyncCancelled, CacheFull for a full disk, or
    the first worker's error."""
    stop = threading.Event()

    def on_bytes(n: int) -> None:
        if sync.cancelled():
            stop.set()  # every worker stops at its next chunk
        sync.add(n, total)

    workers = max(1, min(settings.CACHE_SYNC_WORKERS, len(fetch)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cache-sync") as pool:
        futures = [pool.submit(_fetch_file, sync.store, sync.prefix, f, sync.local_dir, on_bytes, stop,
                               hash_bytes=sync.verify) for f in fetch]
        cancelled = _watch_fetches(sync, futures, stop, total)
    if cancelled:
        raise SyncCancelled(f"the copy of {sync.prefix} was cancelled")
    errors = [failure for fut in futures if (failure := fut.exception()) and not isinstance(failure, _Cancelled)]
    if errors:
        if isinstance(errors[0], OSError) and errors[0].errno == errno.ENOSPC:
            raise _disk_full(sync.local_dir, sync.prefix) from errors[0]
        raise errors[0]
    sync.stats.files_fetched = len(fetch)
    sync.stats.bytes_fetched = sum(f.size for f in fetch)


def _copy(sync: _Sync, manifest: Manifest, fetch: list[ManifestFile], keep: list[ManifestFile]) -> None:
    """Fetch what differs and write the local manifest last. The cache row says SYNCING meanwhile,
    then MISSING when cancelled or FAILED (with the bytes done) when it failed."""
    total = manifest.size_bytes
    sync.stats.files_kept = len(keep)
    sync.done = sum(f.size for f in keep)
    sync.record(state="SYNCING", bytes_done=sync.done, bytes_total=total, error="")
    sync.report(sync.done, total)
    try:
        if fetch:
            _fetch_all(sync, fetch, total)
        _write_local_manifest(sync.local_dir, manifest)
    except SyncCancelled as exc:
        sync.record(state="MISSING", bytes_done=0, bytes_total=total, error=str(exc))
        raise
    except BaseException as exc:
        sync.record(state="FAILED", bytes_done=sync.done, bytes_total=total,
                    error=f"{exc.__class__.__name__}: {exc}"[:2000])
        raise


def sync_to_cache(
    prefix: str,
    *,
    node_name: str,
    progress: Progress | None = None,
    store: ModelStore | None = None,
    verify: bool = False,
    cancel: threading.Event | None = None,
) -> Path:
    """Make MODELS_DIR/<prefix> a verified copy of the store model and return that folder.

    Only files that differ from the manifest (size, ETag, sha256) are fetched; each fetched file
    must match the manifest's size and ETag. `verify=True` also hashes every fetched byte and
    re-hashes every cached file even when its recorded size and mtime match. Raises
    ModelNotInStore for an incomplete or missing model, CacheError/StoreError on failure; a
    failed or killed sync never leaves a file or a local manifest that passes as complete.
    Setting `cancel` stops the copy at its next chunk: it removes its *.part files and raises
    SyncCancelled (files already verified stay, for the next sync to keep).
    """
    prefix = validate_prefix(prefix)
    sync = _Sync(prefix=prefix, node_name=node_name, store=store or get_store(), local_dir=cache_dir_for(prefix),
                 verify=verify, progress=progress, cancel=cancel)
    manifest = _store_manifest(sync)
    if manifest is None:
        return sync.local_dir  # the store is down; the verified copy serves
    last_sync_stats[prefix] = sync.stats
    if _already_cached(sync, manifest, read_local_manifest(sync.local_dir)):
        return sync.local_dir
    with model_lock(prefix):
        if sync.cancelled():
            raise SyncCancelled(f"the copy of {prefix} was cancelled")
        # Another thread or process may have finished the same sync while we waited.
        local = read_local_manifest(sync.local_dir)
        if _already_cached(sync, manifest, local):
            return sync.local_dir
        fetch, keep = _prepare_folder(sync, manifest, local)
        _ensure_room(sync, fetch, manifest.size_bytes)
        _copy(sync, manifest, fetch, keep)
    total = manifest.size_bytes
    sync.record(state="READY", bytes_done=total, bytes_total=total, error="",
                manifest={"files": len(manifest.files), "size_bytes": total, "created_at": manifest.created_at})
    log.info("cache %s: fetched %d files (%d bytes), kept %d", prefix, sync.stats.files_fetched,
             sync.stats.bytes_fetched, sync.stats.files_kept)
    return sync.local_dir


def _safe_record(node_name: str, prefix: str, **fields) -> None:
    # A sync runs on worker threads that outlive database restarts: the bridge gives each
    # record a working connection (closed around it, retried once if lost).
    try:
        run_db_sync(_cache_entry, node_name, prefix, **fields)
    except Exception:  # bookkeeping must never fail a sync
        log.warning("could not record cache state of %s on %s", prefix, node_name, exc_info=True)


def resolve_model_path(local_dir: Path, fmt: str, filename: str | None = None) -> Path:
    """The path a backend loads from a cached model (the rules are `hub.layout.model_to_serve`):
    the .gguf file (the one asked for, or the first shard / largest) for GGUF; the folder holding
    config.json for a Hugging Face snapshot."""
    local_dir = Path(local_dir)
    if fmt not in layout.FORMATS:
        raise InvalidPrefix(f"unknown format {fmt!r}")
    if fmt == layout.GGUF and filename:
        target = safe_join(local_dir, filename)
        if not target.is_file():
            raise CacheError(f"{filename} is not in {local_dir}")
        return target
    found = layout.model_to_serve(local_dir, fmt)
    if found is None:
        raise CacheError(f"no .gguf file in {local_dir}" if fmt == layout.GGUF else f"no config.json in {local_dir}")
    return found


__all__ = [
    "CacheCorrupt", "CacheError", "ModelNotInStore", "MANIFEST_NAME", "StoreError", "SyncCancelled", "cache_dir_for",
    "is_cached", "model_lock", "resolve_model_path", "sync_to_cache",
]
