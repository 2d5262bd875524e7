"""The ModelArtifact index: the store's listing kept in the database (the store is the truth)."""
from __future__ import annotations

import json
from typing import Any

from django.db import transaction
from django.utils import timezone

from hub import layout
from hub.ggufmeta import arch_header_from, has_kv_shape, hf_arch_header
from hub.models import ModelArtifact, PrefixLock
from hub.paths import validate_prefix
from hub.store import ModelStore, StoredModel, get_store

# Ranged reads of a stored GGUF's start, tried in turn until its architecture keys are in: they come
# before the vocabulary (all of them within the first 0.4 KiB of the tiny models, 0.7 KiB of the
# demo model's file).
HEAD_READS = (16 * 1024, 1024 * 1024, 16 * 1024 * 1024)


HF_CONFIG_MAX = 1024 * 1024  # a config.json larger than this is not read for the estimate


def stored_model_header(store: ModelStore, prefix: str, fmt: str, files: list[dict[str, Any]],
                        cached: dict[str, Any] | None) -> dict[str, Any]:
    """What sizes a store model, with the file and ETag it was read from: a GGUF's architecture
    keys (hub.ggufmeta.arch_header, from ranged reads of its start: HEAD_READS), or a Hugging Face
    folder's (hub.ggufmeta.hf_arch_header, from its config.json). `cached` when it came from the
    same file; {} when the store cannot be read or the file says nothing of it: the memory
    estimate then falls back to the model's size. Read when a model is indexed, so a load of an
    indexed model does not wait on the store for it."""
    sizes = [(str(f.get("path", "")), int(f.get("size") or 0)) for f in files or ()]
    if fmt == layout.GGUF:
        rel = layout.pick_gguf(sizes)
    elif fmt == layout.HUGGINGFACE:
        root = layout.hf_root_rel(r for r, _ in sizes)
        rel = None if root is None else (f"{root}/{layout.HF_CONFIG}" if root else layout.HF_CONFIG)
    else:
        rel = None
    if rel is None:
        return {}
    etag = next((str(f.get("etag") or "") for f in files if f.get("path") == rel), "")
    if cached and cached.get("file") == rel and cached.get("etag") == etag:
        return cached
    head: dict[str, Any] = {}
    try:
        if fmt == layout.HUGGINGFACE:
            if dict(sizes).get(rel, 0) <= HF_CONFIG_MAX:
                head = hf_arch_header(json.loads(store.get_bytes(f"{prefix}/{rel}")))
        else:
            for length in HEAD_READS:
                buf = store.get_head(f"{prefix}/{rel}", length)
                head = arch_header_from(buf)
                # The KV heads (which models without grouped-query attention leave out) may lie past a
                # read that ends between keys: read on, unless this was the whole file.
                if has_kv_shape(head) and ("n_head_kv" in head or len(buf) < length):
                    break
    except Exception:  # noqa: BLE001 - a store that cannot be read leaves the size-based estimate
        return {}
    return {**head, "file": rel, "etag": etag} if has_kv_shape(head) else {}


def _header_of(store: ModelStore, model: StoredModel, cached: dict[str, Any] | None) -> dict[str, Any]:
    if not model.complete:
        return {}
    return stored_model_header(store, model.prefix, model.format, model.files, cached)


def _upsert_artifact(model: StoredModel, *, store: ModelStore, source_repo: str = "",
                     source_revision: str = "") -> ModelArtifact:
    cached = ModelArtifact.objects.filter(prefix=model.prefix).values_list("model_header", flat=True).first()
    defaults = {
        "format": model.format,
        "name": model.prefix.split("/", 1)[1],
        "files": model.files,
        "size_bytes": model.size_bytes,
        "file_count": model.file_count,
        "complete": model.complete,
        "model_header": _header_of(store, model, cached),
        "indexed_at": timezone.now(),
    }
    if source_repo:
        defaults["source_repo"] = source_repo
        defaults["source_revision"] = source_revision[:64]
    artifact, _ = ModelArtifact.objects.update_or_create(prefix=model.prefix, defaults=defaults)
    return artifact


def refresh_index(*, store: ModelStore | None = None) -> int:
    """Make the ModelArtifact table match the store (one listing per format, bulk writes);
    returns the model count. Source repo and revision, known only to the index, are kept. Rows of
    prefixes a writer holds the lock of are the writer's to set (it re-indexes when it ends), and so
    are rows a writer indexed while the listing ran: the listing is older than they are."""
    store = store or get_store()
    started = timezone.now()
    locked = set(PrefixLock.objects.values_list("prefix", flat=True))
    models = store.scan_models()
    locked |= set(PrefixLock.objects.values_list("prefix", flat=True))
    existing = {a.prefix: a for a in ModelArtifact.objects.all() if a.prefix not in locked}
    fields = ("format", "name", "files", "size_bytes", "file_count", "complete", "model_header", "indexed_at")
    new, changed = [], []
    for model in models:
        if model.prefix in locked:
            continue
        row = existing.pop(model.prefix, None)
        values = {"format": model.format, "name": model.prefix.split("/", 1)[1], "files": model.files,
                  "size_bytes": model.size_bytes, "file_count": model.file_count, "complete": model.complete,
                  "model_header": _header_of(store, model, row.model_header if row is not None else None),
                  "indexed_at": started}
        if row is None:
            new.append(ModelArtifact(prefix=model.prefix, **values))
        elif row.indexed_at >= started:
            continue  # a writer indexed it after the listing began
        elif any(getattr(row, k) != v for k, v in values.items() if k != "indexed_at"):
            for k, v in values.items():
                setattr(row, k, v)
            changed.append(row)
    stale = [prefix for prefix, row in existing.items() if row.indexed_at < started]
    with transaction.atomic():
        if changed:  # rows a writer re-indexed since they were read are the writer's
            fresh = set(ModelArtifact.objects.filter(pk__in=[r.pk for r in changed], indexed_at__gte=started)
                        .values_list("pk", flat=True))
            changed = [r for r in changed if r.pk not in fresh]
        ModelArtifact.objects.bulk_create(new, batch_size=500, ignore_conflicts=True)
        ModelArtifact.objects.bulk_update(changed, fields, batch_size=500)
        if stale:
            ModelArtifact.objects.filter(prefix__in=stale, indexed_at__lt=started).delete()
    return len(models)


def index_prefix(prefix: str, *, store: ModelStore | None = None, source_repo: str = "",
                 source_revision: str = "") -> ModelArtifact | None:
    """Refresh the index row of one model from the store; None (and no row) when it has no objects."""
    prefix = validate_prefix(prefix)
    store = store or get_store()
    objects = store.list_files(prefix)
    if not objects and not store.exists(prefix):
        ModelArtifact.objects.filter(prefix=prefix).delete()
        return None
    model = StoredModel(prefix=prefix, format=prefix.split("/", 1)[0])
    for obj in objects:
        model.files.append({"path": obj.key[len(prefix) + 1 :], "size": obj.size, "etag": obj.etag})
        model.size_bytes += obj.size
        model.file_count += 1
    model.complete = store.exists(prefix)
    return _upsert_artifact(model, store=store, source_repo=source_repo, source_revision=source_revision)


__all__ = ["index_prefix", "refresh_index", "stored_model_header"]
