"""The ModelArtifact index: the store's listing kept in the database (the store is the truth)."""
from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from hub.models import ModelArtifact, PrefixLock
from hub.paths import validate_prefix
from hub.store import ModelStore, StoredModel, get_store


def _upsert_artifact(model: StoredModel, *, source_repo: str = "", source_revision: str = "") -> ModelArtifact:
    defaults = {
        "format": model.format,
        "name": model.prefix.split("/", 1)[1],
        "files": model.files,
        "size_bytes": model.size_bytes,
        "file_count": model.file_count,
        "complete": model.complete,
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
    fields = ("format", "name", "files", "size_bytes", "file_count", "complete", "indexed_at")
    new, changed = [], []
    for model in models:
        if model.prefix in locked:
            continue
        values = {"format": model.format, "name": model.prefix.split("/", 1)[1], "files": model.files,
                  "size_bytes": model.size_bytes, "file_count": model.file_count, "complete": model.complete,
                  "indexed_at": started}
        row = existing.pop(model.prefix, None)
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
    return _upsert_artifact(model, source_repo=source_repo, source_revision=source_revision)


__all__ = ["index_prefix", "refresh_index"]
