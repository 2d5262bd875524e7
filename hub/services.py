"""Writes for the hub: the ModelArtifact index, uploads, deletes, and download jobs."""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

from django.db import transaction
from django.utils import timezone

from hub.models import DOWNLOAD_ACTIVE, CacheEntry, DownloadJob, DownloadStatus, ModelArtifact, ModelFormat
from hub.paths import FORMAT_ROOTS, InvalidPrefix, name_from_repo_id, prefix_for, validate_prefix
from hub.store import ModelStore, StoredModel, get_store

log = logging.getLogger("xgen.hub")

REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
PATTERN_RE = re.compile(r"^[A-Za-z0-9._*?\[\]/ -]{1,200}$")
MAX_PATTERNS = 50


class HubInputError(ValueError):
    """Input that the API answers with 400 (message is shown to the user)."""


# --------------------------------------------------------------------------- the index
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
    returns the model count. Source repo and revision, known only to the index, are kept."""
    store = store or get_store()
    models = store.scan_models()
    now = timezone.now()
    existing = {a.prefix: a for a in ModelArtifact.objects.all()}
    fields = ("format", "name", "files", "size_bytes", "file_count", "complete", "indexed_at")
    new, changed = [], []
    for model in models:
        values = {"format": model.format, "name": model.prefix.split("/", 1)[1], "files": model.files,
                  "size_bytes": model.size_bytes, "file_count": model.file_count, "complete": model.complete,
                  "indexed_at": now}
        row = existing.pop(model.prefix, None)
        if row is None:
            new.append(ModelArtifact(prefix=model.prefix, **values))
        elif any(getattr(row, k) != v for k, v in values.items() if k != "indexed_at"):
            for k, v in values.items():
                setattr(row, k, v)
            changed.append(row)
    with transaction.atomic():
        ModelArtifact.objects.bulk_create(new, batch_size=500)
        ModelArtifact.objects.bulk_update(changed, fields, batch_size=500)
        if existing:
            ModelArtifact.objects.filter(prefix__in=list(existing)).delete()
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


# --------------------------------------------------------------------------- uploads and deletes
def validate_upload(*, local_path: str, format: str, name: str) -> tuple[str, Path]:
    """Check an upload request before any transfer; returns (prefix, local path)."""
    if format not in FORMAT_ROOTS:
        raise HubInputError(f"Unknown format {format!r}: use gguf or huggingface.")
    prefix = prefix_for(format, name)  # InvalidPrefix for a traversal attempt in name
    if not local_path or "\x00" in local_path:
        raise HubInputError("local_path is empty.")
    path = Path(local_path)
    if not path.is_absolute():
        raise HubInputError(f"local_path must be an absolute path on the server, not {local_path!r}.")
    if not path.exists():
        raise HubInputError(f"{local_path} does not exist on the server.")
    if format == ModelFormat.GGUF and path.is_file() and path.suffix != ".gguf":
        raise HubInputError(f"{local_path} is not a .gguf file.")
    if format == ModelFormat.GGUF and path.is_dir() and not any(path.rglob("*.gguf")):
        raise HubInputError(f"{local_path} holds no .gguf file.")
    if format == ModelFormat.HUGGINGFACE and not (path.is_dir() and any(path.rglob("config.json"))):
        raise HubInputError(f"{local_path} is not a Hugging Face model folder (no config.json).")
    return prefix, path


def upload_local_model(
    *,
    local_path: str,
    format: str,
    name: str,
    store: ModelStore | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ModelArtifact:
    """Upload a local file or folder (on this host) into the store as `<format>/<name>` and index it."""
    prefix, path = validate_upload(local_path=local_path, format=format, name=name)
    store = store or get_store()
    store.upload_model(prefix, path, source={"local_path": str(path)}, progress=progress)
    return index_prefix(prefix, store=store)


def delete_model(*, prefix: str, store: ModelStore | None = None) -> int:
    """Delete a model from the store (manifest first) and from the index; returns objects removed."""
    prefix = validate_prefix(prefix)
    if prefix.count("/") != 1:
        raise InvalidPrefix(f"{prefix!r} is not a model prefix (format/name).")
    store = store or get_store()
    removed = store.delete_model(prefix)
    ModelArtifact.objects.filter(prefix=prefix).delete()
    CacheEntry.objects.filter(prefix=prefix).delete()
    return removed


# --------------------------------------------------------------------------- download jobs
def validate_download(*, repo_id: str, revision: str | None, format: str,
                      allow_patterns: list[str] | None) -> tuple[str, str, str, list[str]]:
    """Clean the fields of a download request or raise HubInputError / InvalidPrefix."""
    repo_id = (repo_id or "").strip()
    if not REPO_ID_RE.match(repo_id) or ".." in repo_id:
        raise InvalidPrefix(f"Invalid repository id {repo_id!r}: use 'owner/name'.")
    revision = (revision or "").strip()
    if revision and (not REVISION_RE.match(revision) or ".." in revision or "//" in revision):
        raise InvalidPrefix(f"Invalid revision {revision!r}.")
    if format not in FORMAT_ROOTS:
        raise HubInputError(f"Unknown format {format!r}: use gguf or huggingface.")
    patterns = [p.strip() for p in (allow_patterns or []) if p and p.strip()]
    if len(patterns) > MAX_PATTERNS:
        raise HubInputError(f"At most {MAX_PATTERNS} allow patterns.")
    for p in patterns:
        if not PATTERN_RE.match(p) or ".." in p or p.startswith("/"):
            raise InvalidPrefix(f"Invalid allow pattern {p!r}.")
    return repo_id, revision, format, patterns


def create_download_job(*, repo_id: str, revision: str | None = None, format: str,
                        allow_patterns: list[str] | None = None, user=None) -> DownloadJob:
    """Queue a Hugging Face download; a hub agent worker claims it."""
    repo_id, revision, format, patterns = validate_download(repo_id=repo_id, revision=revision, format=format,
                                                           allow_patterns=allow_patterns)
    target = prefix_for(format, name_from_repo_id(repo_id))
    return DownloadJob.objects.create(repo_id=repo_id, revision=revision, format=format, allow_patterns=patterns,
                                      target_prefix=target, created_by=user)


def claim_next_job(*, node_name: str) -> DownloadJob | None:
    """Take the oldest PENDING job; a conditional UPDATE makes sure only one agent gets it."""
    pending = DownloadJob.objects.filter(status=DownloadStatus.PENDING).order_by("created_at")
    for job_id in pending.values_list("pk", flat=True)[:5]:
        taken = DownloadJob.objects.filter(pk=job_id, status=DownloadStatus.PENDING).update(
            status=DownloadStatus.DOWNLOADING, node=node_name, started_at=timezone.now())
        if taken:
            return DownloadJob.objects.get(pk=job_id)
    return None


def request_cancel(*, job: DownloadJob) -> DownloadJob:
    """Ask for a job to stop. A job nobody has claimed yet is cancelled at once."""
    if DownloadJob.objects.filter(pk=job.pk, status=DownloadStatus.PENDING).update(
            status=DownloadStatus.CANCELLED, cancel_requested=True, finished_at=timezone.now(),
            error="Cancelled before it started."):
        return DownloadJob.objects.get(pk=job.pk)
    DownloadJob.objects.filter(pk=job.pk, status__in=DOWNLOAD_ACTIVE).update(cancel_requested=True)
    return DownloadJob.objects.get(pk=job.pk)


def update_job(job_id: int, **fields) -> DownloadJob:
    """Write progress or a state change; a finished job is never reopened."""
    DownloadJob.objects.filter(pk=job_id).update(**fields)
    return DownloadJob.objects.get(pk=job_id)


def finish_job(job_id: int, *, status: str, error: str = "") -> DownloadJob:
    """Move an active job to COMPLETED, FAILED or CANCELLED (only from an active state)."""
    DownloadJob.objects.filter(pk=job_id, status__in=DOWNLOAD_ACTIVE).update(
        status=status, error=error[:4000], finished_at=timezone.now())
    return DownloadJob.objects.get(pk=job_id)


def fail_orphaned_jobs(*, node_name: str) -> int:
    """Jobs this node had claimed before it restarted can't be resumed: mark them FAILED."""
    return DownloadJob.objects.filter(node=node_name, status__in=[DownloadStatus.DOWNLOADING,
                                                                  DownloadStatus.UPLOADING]).update(
        status=DownloadStatus.FAILED, error="The node agent restarted while this download ran.",
        finished_at=timezone.now())
