"""Writing a model into the store (the one way: upload jobs, `manage.py hub_upload`, downloads),
deleting one, and cleaning up after writes that died."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.utils import timezone

from hub.imports import UPLOAD_SCAN_MAX_ENTRIES, HubInputError, ImportSource, check_import_path
from hub.index import index_prefix
from hub.layout import layout_problem
from hub.locks import busy_prefixes, prefix_locked, process_holder
from hub.models import ModelArtifact
from hub.node_cache import evict_everywhere
from hub.paths import FORMAT_ROOTS, InvalidPrefix, prefix_for, validate_prefix
from hub.store import LocalFile, ModelExists, ModelStore, StoreError, get_store

log = logging.getLogger("xgen.hub")


def after_failed_write(prefix: str, *, store: ModelStore) -> None:
    """After a write that failed or was cancelled nothing may look loadable: what it left of a model
    with no manifest is removed, and the index row follows the store. When the store cannot be
    read (the usual reason for the failure) the row is marked incomplete."""
    try:
        if not store.exists(prefix) and not store.staged_switches(prefix):  # a switch cut short is finished later
            store.delete_model(prefix)
        index_prefix(prefix, store=store)
    except Exception as exc:
        log.warning("after the failed write of %s the store could not be re-read: %s", prefix, exc)
        ModelArtifact.objects.filter(prefix=prefix).update(complete=False, indexed_at=timezone.now())


def write_model(prefix: str, local: Path, *, store: ModelStore, files: list[LocalFile] | None = None,
                source: dict[str, Any] | None = None, progress: Callable[[int, int], None] | None = None,
                cancel: threading.Event | None = None, replace: bool = False, source_repo: str = "",
                source_revision: str = "") -> ModelArtifact:
    """Write a local model into the store as `prefix` and index it: the one way the console writes
    a model (upload jobs, `manage.py hub_upload`, downloads). The caller holds the prefix's lock.

    A complete model is overwritten only with `replace` (else ModelExists, nothing touched). The
    new files are written beside it (the store's staging area) and switched in once all are there:
    until then the old model stays listed, complete and loadable, and a cancel or a failure leaves
    it as it was. Any failure re-indexes the prefix (`after_failed_write`), so the listing never
    calls a broken model complete.
    """
    if store.exists(prefix) and not replace:
        raise ModelExists(f"{prefix} is already a complete model in the store: upload it under another "
                          "name, or ask to replace it.")
    try:
        store.upload_model(prefix, local, files=files, source=source, progress=progress, cancel=cancel,
                           replace=replace)
    except ModelExists:
        raise  # refused before anything was written
    except BaseException:
        after_failed_write(prefix, store=store)
        raise
    artifact = index_prefix(prefix, store=store, source_repo=source_repo, source_revision=source_revision)
    if artifact is None:  # not reached: the store holds what it has just written
        raise StoreError(f"{prefix} is not in the store after it was written")
    return artifact


def validate_upload(*, local_path: str, format: str, name: str,
                    limit_to_import_dirs: bool = True) -> tuple[str, ImportSource]:
    """Check an upload request before any transfer; returns (prefix, the checked local source)."""
    if format not in FORMAT_ROOTS:
        raise HubInputError(f"Unknown format {format!r}: use gguf, huggingface or lora.")
    prefix = prefix_for(format, name)  # InvalidPrefix for a traversal attempt in name
    source = check_import_path(local_path, limit_to_import_dirs=limit_to_import_dirs,
                               max_entries=UPLOAD_SCAN_MAX_ENTRIES if limit_to_import_dirs else None)
    problem = layout_problem(format, [f.rel for f in source.files], is_dir=source.is_dir, name=local_path)
    if problem:
        raise HubInputError(problem)
    return prefix, source


def upload_local_model(
    *,
    local_path: str,
    format: str,
    name: str,
    store: ModelStore | None = None,
    progress: Callable[[int, int], None] | None = None,
    cancel: threading.Event | None = None,
    limit_to_import_dirs: bool = True,
    replace: bool = False,
) -> ModelArtifact:
    """Upload a local file or folder (on this host) into the store as `<format>/<name>` and index it.

    Only what `check_import_path` allows; `limit_to_import_dirs=False` is for `manage.py hub_upload`.
    The caller holds the prefix's lock (an upload job from its creation on; the CLI around this call).
    """
    prefix, source = validate_upload(local_path=local_path, format=format, name=name,
                                     limit_to_import_dirs=limit_to_import_dirs)
    return write_model(prefix, source.real if source.is_dir else source.path, store=store or get_store(),
                       files=source.files, source={"local_path": str(source.path)}, progress=progress,
                       cancel=cancel, replace=replace)


def finish_interrupted_switches(*, store: ModelStore | None = None) -> list[str]:
    """Finish the replaces whose every file was written but whose switch was cut short (the store
    went away mid-copy on S3, a `kill -9` between two renames) and index them; the agent runs it at
    start and with each index refresh. Returns the prefixes switched."""
    store = store or get_store()
    switched = store.finish_switches(busy=busy_prefixes)
    for prefix in switched:
        log.warning("finished the switch of %s to the version a cut-short write had put in the store", prefix)
        index_prefix(prefix, store=store)
    return switched


def sweep_store(*, store: ModelStore | None = None) -> list[str]:
    """Remove what writes that died left in the store (a `kill -9` mid-upload: staging areas,
    `*.xgen-part` files, incomplete multipart uploads), sparing every model a writer holds now,
    once the switches that can be finished are (`finish_interrupted_switches`). The agent runs it
    at start, after ending the jobs its last run left."""
    store = store or get_store()
    finish_interrupted_switches(store=store)
    removed = store.sweep(busy=busy_prefixes)
    if removed:
        log.warning("removed %d leftover(s) of interrupted writes from the store: %s", len(removed),
                    ", ".join(removed[:5]) + (" ..." if len(removed) > 5 else ""))
    return removed


def delete_model(*, prefix: str, store: ModelStore | None = None) -> int:
    """Delete a model from the store (manifest first) and from the index; returns objects removed.
    PrefixBusy while another writer holds the model's lock."""
    prefix = validate_prefix(prefix)
    if prefix.count("/") != 1:
        raise InvalidPrefix(f"{prefix!r} is not a model prefix (format/name).")
    store = store or get_store()
    with prefix_locked(prefix, holder=process_holder("delete")):
        removed = store.delete_model(prefix)
        ModelArtifact.objects.filter(prefix=prefix).delete()
        # Node caches follow: copies no instance uses are evicted by their agents; a copy in use
        # stays until its instance stops (a later Evict or XGEN_CACHE_MAX_GB removes it).
        evict_everywhere(prefix)
    return removed


__all__ = ["after_failed_write", "delete_model", "finish_interrupted_switches", "sweep_store", "upload_local_model",
           "validate_upload", "write_model"]
