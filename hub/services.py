"""Writes for the hub: the ModelArtifact index, uploads, deletes, and download jobs."""
from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from hub.layout import layout_problem
from hub.models import DOWNLOAD_ACTIVE, CacheEntry, DownloadJob, DownloadStatus, ModelArtifact
from hub.paths import FORMAT_ROOTS, InvalidPrefix, name_from_repo_id, prefix_for, validate_prefix
from hub.store import LocalFile, ModelExists, ModelStore, NotARegularFile, StoredModel, get_store, local_files

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


# --------------------------------------------------------------------------- local paths an upload may read
def console_paths() -> list[tuple[str, Path]]:
    """(what, resolved path) of the console's own folders and database files: no upload reads these.

    The data dir holds the secret key and the SQLite database (sessions, key hashes); merely
    opening and closing the live database file in this process drops its SQLite locks.
    """
    found = [("data dir (XGEN_DATA_DIR)", settings.DATA_DIR), ("store dir (XGEN_STORE_DIR)", settings.STORE_DIR),
             ("models dir (XGEN_MODELS_DIR)", settings.MODELS_DIR), ("log dir (XGEN_LOG_DIR)", settings.LOG_DIR)]
    for db in settings.DATABASES.values():
        if "sqlite" not in db.get("ENGINE", ""):
            continue
        for name in (db.get("NAME"), (db.get("TEST") or {}).get("NAME")):
            name = str(name or "")
            if name and name != ":memory:" and not name.startswith("file:"):
                found += [("database", Path(name + suffix)) for suffix in ("", "-wal", "-shm", "-journal")]
    return [(what, Path(os.path.realpath(path))) for what, path in found]


def _console_path_of(real: Path, own: list[tuple[str, Path]]) -> str | None:
    return next((what for what, path in own if real.is_relative_to(path)), None)


def _allowed(real: Path, import_dirs: list[Path] | None) -> bool:
    return import_dirs is None or any(real.is_relative_to(d) for d in import_dirs)


@dataclass(frozen=True)
class ImportSource:
    """A local path an upload may read: as named, resolved, and its files (all checked)."""

    path: Path
    real: Path
    is_dir: bool
    files: list[LocalFile]


def check_import_path(local_path: str, *, limit_to_import_dirs: bool = True) -> ImportSource:
    """Decide whether a local file or folder may be uploaded into the store; HubInputError if not.

    The one check every upload goes through (the API, the Upload page, `manage.py hub_upload`), run
    before anything is opened or written. On the resolved path (symlinks followed) of the path named
    and of every file a folder holds:
    - it must lie under one of settings.IMPORT_DIRS (XGEN_IMPORT_DIRS; none set: local uploads are
      off). `limit_to_import_dirs=False` lifts this rule only, for `manage.py hub_upload`, which
      runs as the host's admin;
    - it must never lie inside the console's data, store, models or log dir, nor be its SQLite
      database, and a folder named must not hold one of those;
    - a folder must hold only regular files: a FIFO, socket or device refuses the whole upload.
    The files returned are what the store uploads; `open_local` checks each is still the same file.
    """
    if not local_path or "\x00" in local_path:
        raise HubInputError("local_path is empty.")
    try:
        os.fsencode(local_path)
    except UnicodeEncodeError:
        raise HubInputError("local_path is not a valid file name on this server.") from None
    path = Path(local_path)
    if not path.is_absolute():
        raise HubInputError(f"local_path must be an absolute path on the server, not {local_path!r}.")
    import_dirs = None
    if limit_to_import_dirs:
        import_dirs = [Path(os.path.realpath(d)) for d in settings.IMPORT_DIRS]
        if not import_dirs:
            raise HubInputError("Uploads from local paths are off on this server: set XGEN_IMPORT_DIRS to the "
                                "folders (comma separated) that uploads may read from.")
    real = Path(os.path.realpath(path))
    via = f" (it leads to {real})" if real != path else ""
    if not _allowed(real, import_dirs):
        raise HubInputError(f"{local_path}{via} is not under XGEN_IMPORT_DIRS "
                            f"({', '.join(str(d) for d in import_dirs)}): uploads read only from those folders.")
    own = console_paths()
    what = _console_path_of(real, own)
    if what:
        raise HubInputError(f"{local_path}{via} is inside the console's {what}, which can never be uploaded.")
    try:
        is_dir = real.is_dir()
        if is_dir:
            held = next((w for w, p in own if p.is_relative_to(real)), None)
            if held:
                raise HubInputError(f"{local_path}{via} holds the console's {held}, which can never be uploaded.")
        files = local_files(real) if is_dir else local_files(path)
        if not is_dir and not files:
            raise HubInputError(f"{local_path} does not exist on the server.")
    except NotARegularFile as exc:
        raise HubInputError(str(exc)) from None
    except OSError as exc:
        raise HubInputError(f"{local_path} cannot be read: {exc.strerror or exc}.") from None
    for f in files:
        if not _allowed(f.real, import_dirs):
            raise HubInputError(f"{local_path} holds {f.path}, which leads to {f.real}, not under XGEN_IMPORT_DIRS: "
                                "nothing was uploaded.")
        what = _console_path_of(f.real, own)
        if what:
            raise HubInputError(f"{local_path} holds {f.path}, which leads into the console's {what}: "
                                "nothing was uploaded.")
    return ImportSource(path=path, real=real, is_dir=is_dir, files=files)


# --------------------------------------------------------------------------- writing a model
def after_failed_write(prefix: str, *, store: ModelStore) -> None:
    """After a write that failed or was cancelled nothing may look loadable: what it left of a model
    with no manifest is removed, and the index row follows the store. When the store cannot be
    read (the usual reason for the failure) the row is marked incomplete."""
    try:
        if not store.exists(prefix):
            store.delete_model(prefix)
        index_prefix(prefix, store=store)
    except Exception as exc:
        log.warning("after the failed write of %s the store could not be re-read: %s", prefix, exc)
        ModelArtifact.objects.filter(prefix=prefix).update(complete=False, indexed_at=timezone.now())


def write_model(prefix: str, local: Path, *, store: ModelStore, files: list[LocalFile] | None = None,
                source: dict | None = None, progress: Callable[[int, int], None] | None = None,
                cancel: threading.Event | None = None, replace: bool = False, source_repo: str = "",
                source_revision: str = "") -> ModelArtifact:
    """Write a local model into the store as `prefix` and index it: the one way the console writes
    a model (uploads, `manage.py hub_upload`, downloads).

    A complete model is overwritten only with `replace` (else ModelExists, nothing touched); its
    index row says incomplete from before the old manifest goes until the new one is written.
    Any failure re-indexes the prefix (`after_failed_write`), so the listing never calls a broken
    model complete.
    """
    existing = store.exists(prefix)
    if existing and not replace:
        raise ModelExists(f"{prefix} is already a complete model in the store: upload it under another "
                          "name, or ask to replace it.")
    if existing:
        ModelArtifact.objects.filter(prefix=prefix).update(complete=False, indexed_at=timezone.now())
    try:
        store.upload_model(prefix, local, files=files, source=source, progress=progress, cancel=cancel,
                           replace=replace)
    except ModelExists:
        raise  # refused before anything was written
    except BaseException:
        after_failed_write(prefix, store=store)
        raise
    return index_prefix(prefix, store=store, source_repo=source_repo, source_revision=source_revision)


def validate_upload(*, local_path: str, format: str, name: str,
                    limit_to_import_dirs: bool = True) -> tuple[str, ImportSource]:
    """Check an upload request before any transfer; returns (prefix, the checked local source)."""
    if format not in FORMAT_ROOTS:
        raise HubInputError(f"Unknown format {format!r}: use gguf or huggingface.")
    prefix = prefix_for(format, name)  # InvalidPrefix for a traversal attempt in name
    source = check_import_path(local_path, limit_to_import_dirs=limit_to_import_dirs)
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
    """
    prefix, source = validate_upload(local_path=local_path, format=format, name=name,
                                     limit_to_import_dirs=limit_to_import_dirs)
    return write_model(prefix, source.real if source.is_dir else source.path, store=store or get_store(),
                       files=source.files, source={"local_path": str(source.path)}, progress=progress,
                       cancel=cancel, replace=replace)


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
