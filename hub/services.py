"""Writes for the hub: the ModelArtifact index, the per-model write lock, uploads (jobs and the
CLI), deletes, and download jobs."""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from hub.layout import (
    GGUF,
    HF_CONFIG,
    HUGGINGFACE,
    FolderTooLarge,
    is_gguf,
    layout_problem,
    pick_gguf,
    weights_size,
)
from hub.models import (
    DOWNLOAD_ACTIVE,
    UPLOAD_ACTIVE,
    DownloadJob,
    DownloadStatus,
    ModelArtifact,
    PrefixLock,
    UploadJob,
    UploadStatus,
)
from hub.node_cache import evict_everywhere
from hub.paths import (
    FORMAT_ROOTS,
    InvalidPrefix,
    name_from_repo_id,
    prefix_for,
    validate_prefix,
    validate_relative_path,
)
from hub.store import (
    LocalFile,
    ModelExists,
    ModelStore,
    NotARegularFile,
    StoredModel,
    StoreError,
    UploadCancelled,
    get_store,
    local_files,
    open_local,
)

log = logging.getLogger("xgen.hub")

REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
PATTERN_RE = re.compile(r"^[A-Za-z0-9._*?\[\]/ -]{1,200}$")
MAX_PATTERNS = 50


class HubInputError(ValueError):
    """Input that the API answers with 400 (message is shown to the user)."""


class PrefixBusy(RuntimeError):
    """Another writer (upload, download, CLI, delete) holds the model's lock: the API answers 409."""


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


# --------------------------------------------------------------------------- one writer per model prefix
def process_holder(kind: str) -> str:
    """A lock holder for work done by this process itself (`manage.py hub_upload`, a delete)."""
    return f"{kind}:{socket.gethostname()}:{os.getpid()}"


def _holder_alive(holder: str) -> bool:
    """Whether a lock's holder may still be writing (when in doubt: yes)."""
    kind, _, rest = holder.partition(":")
    if kind in ("upload", "download") and rest.isdigit():
        model, active = (UploadJob, UPLOAD_ACTIVE) if kind == "upload" else (DownloadJob, DOWNLOAD_ACTIVE)
        return model.objects.filter(pk=int(rest), status__in=active).exists()
    host, _, pid = rest.rpartition(":")
    if kind in ("cli", "delete") and pid.isdigit() and host == socket.gethostname():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return True


def describe_holder(holder: str) -> str:
    kind, _, rest = holder.partition(":")
    if kind in ("upload", "download") and rest.isdigit():
        return f"{kind} job {rest}"
    host, _, pid = rest.rpartition(":")
    what = {"cli": "manage.py hub_upload", "delete": "a delete"}.get(kind, kind)
    return f"{what} (pid {pid} on {host})" if pid else what


def lock_prefix(prefix: str, *, holder: str) -> None:
    """Take the write lock of a model prefix for `holder`, or raise PrefixBusy.

    An INSERT on a unique column decides, so it holds across web processes, agents and hosts
    (any database). A lock left by a holder that has ended (a job in a final state, a dead
    `hub_upload` on this host) is taken over.
    """
    for _ in range(3):
        try:
            with transaction.atomic():
                PrefixLock.objects.create(prefix=prefix, holder=holder)
            return
        except IntegrityError:
            current = PrefixLock.objects.filter(prefix=prefix).values_list("holder", flat=True).first()
            if current is None:  # released meanwhile
                continue
            if current == holder:
                return
            if _holder_alive(current):
                raise PrefixBusy(f"{prefix} is being written by {describe_holder(current)}: wait until it has "
                                 "finished, or cancel it.") from None
            log.warning("taking over the write lock of %s from %s, which has ended", prefix, current)
            PrefixLock.objects.filter(prefix=prefix, holder=current).delete()
    raise PrefixBusy(f"{prefix} is being written by another writer: try again.")


def unlock_prefix(prefix: str, *, holder: str) -> None:
    PrefixLock.objects.filter(prefix=prefix, holder=holder).delete()


@contextmanager
def prefix_locked(prefix: str, *, holder: str) -> Iterator[None]:
    """Hold a prefix's write lock for the block (PrefixBusy when another writer has it)."""
    lock_prefix(prefix, holder=holder)
    try:
        yield
    finally:
        unlock_prefix(prefix, holder=holder)


# --------------------------------------------------------------------------- local paths an upload may read
SECRET_FILE_VARS = ("XGEN_SECRET_KEY_FILE", "DATABASE_URL_FILE", "REDIS_URL_FILE", "MINIO_ACCESS_KEY_FILE",
                    "MINIO_SECRET_KEY_FILE", "HF_TOKEN_PATH")
def console_paths() -> list[tuple[str, Path]]:
    """(what, resolved path) of the console's own folders and database files: no upload reads these.

    The data dir holds the secret key and the SQLite database (sessions, key hashes); merely
    opening and closing the live database file in this process drops its SQLite locks.
    """
    found = [("data dir (XGEN_DATA_DIR)", settings.DATA_DIR), ("store dir (XGEN_STORE_DIR)", settings.STORE_DIR),
             ("models dir (XGEN_MODELS_DIR)", settings.MODELS_DIR), ("log dir (XGEN_LOG_DIR)", settings.LOG_DIR)]
    # Secrets read from files (xgenconsole.env.env_secret's NAME_FILE), wherever they are.
    found += [(f"secret file ({name})", Path(os.environ[name])) for name in SECRET_FILE_VARS if os.environ.get(name)]
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


def check_path_text(local_path: str) -> Path:
    """The rules a local path's text must meet wherever it is read: absolute, a valid file name."""
    if not local_path or "\x00" in local_path:
        raise HubInputError("local_path is empty.")
    try:
        os.fsencode(local_path)
    except UnicodeEncodeError:
        raise HubInputError("local_path is not a valid file name on this server.") from None
    path = Path(local_path)
    if not path.is_absolute():
        raise HubInputError(f"local_path must be an absolute path on the server, not {local_path!r}.")
    return path


def _check_file_name(local_path: str, rel: str) -> None:
    """A file's path inside the source becomes a store key: the store's rules for a relative path
    (no backslash, control character, `..` or absolute part) and valid UTF-8, the error naming it."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise HubInputError(f"{local_path} holds {rel!r}, whose name is not valid UTF-8: rename it; "
                            "nothing was copied.") from None
    try:
        validate_relative_path(rel, what="file name")
    except InvalidPrefix as exc:
        raise HubInputError(f"{local_path} holds {rel!r}: {exc} Rename it; nothing was copied.") from None


def check_import_path(local_path: str, *, limit_to_import_dirs: bool = True, action: str = "upload",
                      max_entries: int | None = None) -> ImportSource:
    """Decide whether a local file or folder may be uploaded into the store (or loaded, `action`
    "load"); HubInputError if not.

    The one check every upload and every load from a local path goes through (the API, the Upload
    and Load pages, `manage.py hub_upload`, the node agent before it spawns a backend), run before
    anything is opened or written. On the resolved path (symlinks followed) of the path named and
    of every file a folder holds:
    - it must lie under one of settings.IMPORT_DIRS (XGEN_IMPORT_DIRS; none set: local uploads and
      loads are off). `limit_to_import_dirs=False` lifts this rule only, for `manage.py
      hub_upload`, which runs as the host's admin;
    - it must never lie inside the console's data, store, models or log dir, nor be its SQLite
      database, and a folder named must not hold one of those;
    - a folder must hold only regular files: a FIFO, socket or device refuses the whole upload;
    - every file's path inside the folder must make a valid store key (`_check_file_name`).
    `max_entries` bounds the walk of a folder (a web request never walks `/usr`).
    The files returned are what the store uploads; `open_local` checks each is still the same file.
    """
    path = check_path_text(local_path)
    done = f"nothing was {action}ed"
    import_dirs = None
    if limit_to_import_dirs:
        import_dirs = [Path(os.path.realpath(d)) for d in settings.IMPORT_DIRS]
        if not import_dirs:
            raise HubInputError(f"{action.capitalize()}s from local paths are off on this server: set "
                                f"XGEN_IMPORT_DIRS to the folders (comma separated) that {action}s may read from.")
    real = Path(os.path.realpath(path))
    via = f" (it leads to {real})" if real != path else ""
    if not _allowed(real, import_dirs):
        raise HubInputError(f"{local_path}{via} is not under XGEN_IMPORT_DIRS "
                            f"({', '.join(str(d) for d in import_dirs)}): {action}s read only from those folders.")
    own = console_paths()
    what = _console_path_of(real, own)
    if what:
        raise HubInputError(f"{local_path}{via} is inside the console's {what}, which can never be {action}ed.")
    try:
        is_dir = real.is_dir()
        if is_dir:
            held = next((w for w, p in own if p.is_relative_to(real)), None)
            if held:
                raise HubInputError(f"{local_path}{via} holds the console's {held}, which can never be {action}ed.")
        files = local_files(real, limit=max_entries) if is_dir else local_files(path)
        if not is_dir and not files:
            raise HubInputError(f"{local_path} does not exist on the server.")
    except NotARegularFile as exc:
        raise HubInputError(f"{exc} {done.capitalize()}.") from None
    except FolderTooLarge:
        raise HubInputError(f"{local_path} holds more than {max_entries} files and folders, more than a model "
                            f"folder: name the model's own folder or its .gguf file; {done}.") from None
    except OSError as exc:
        raise HubInputError(f"{local_path} cannot be read: {exc.strerror or exc}.") from None
    for f in files:
        if not _allowed(f.real, import_dirs):
            raise HubInputError(f"{local_path} holds {f.path}, which leads to {f.real}, not under XGEN_IMPORT_DIRS: "
                                f"{done}.")
        what = _console_path_of(f.real, own)
        if what:
            raise HubInputError(f"{local_path} holds {f.path}, which leads into the console's {what}: {done}.")
        if is_dir:
            _check_file_name(local_path, f.rel)
    if not is_dir:
        _check_file_name(local_path, path.name)
    return ImportSource(path=path, real=real, is_dir=is_dir, files=files)


# --------------------------------------------------------------------------- local paths a load may serve
LOAD_SCAN_MAX_ENTRIES = 2000  # a model folder holds a few dozen files; a load never walks more than this
UPLOAD_SCAN_MAX_ENTRIES = 20000  # an upload through the API or a page (not `manage.py hub_upload`)
GGUF_MAGIC = b"GGUF"
MAX_SHARDS = 1000


@dataclass(frozen=True)
class LoadSource:
    """A local path a load may serve, checked: what the backend opens and how big its weights are."""

    path: Path  # as named
    format: str  # gguf | huggingface
    serve: Path  # the .gguf file or the Hugging Face folder the backend opens (symlinks resolved)
    size_bytes: int  # the weights (hub.layout's rules)


def _check_gguf_magic(local_path: str, f: LocalFile) -> None:
    """Four bytes, read the way an upload reads (never a FIFO, the very file checked): a backend is
    never handed a file that is not GGUF (it would echo its first bytes into the instance's log)."""
    try:
        with open_local(f) as fh:
            head = fh.read(len(GGUF_MAGIC))
    except NotARegularFile as exc:
        raise HubInputError(f"{exc} Nothing was loaded.") from None
    except OSError as exc:
        raise HubInputError(f"{local_path} cannot be read: {exc.strerror or exc}.") from None
    if head != GGUF_MAGIC:
        raise HubInputError(f"{f.path} is not a GGUF model file (it does not start with 'GGUF'): nothing was loaded.")


def _shard_files(local_path: str, f: LocalFile) -> list[LocalFile]:
    """The sibling shards a backend opens beside the first one of a split GGUF, each checked like
    the file named (found by name, never by listing the folder)."""
    match = re.search(r"^(.*)-(\d+)-of-(\d+)\.gguf$", f.path.name)
    if not match:
        return [f]
    total = int(match.group(3))
    if total > MAX_SHARDS:
        raise HubInputError(f"{local_path} says it is one of {total} shards: at most {MAX_SHARDS}.")
    width = len(match.group(2))
    out = [f]
    for index in range(1, total + 1):
        sibling = f.path.with_name(f"{match.group(1)}-{index:0{width}d}-of-{match.group(3)}.gguf")
        if sibling != f.path and os.path.lexists(sibling):
            out += check_import_path(str(sibling), action="load").files
    return out


def check_load_path(local_path: str) -> LoadSource:
    """Decide whether a load may serve a local file or folder; HubInputError naming the reason.

    The rules of uploads (`check_import_path`: under XGEN_IMPORT_DIRS, never the console's own dirs
    or database, regular files only), with the walk of a folder bounded (LOAD_SCAN_MAX_ENTRIES):
    the web request checks it (the Load page's verdict, the API), and the node agent checks it again
    on its own disk right before it spawns the backend. A folder with config.json at its top is a
    Hugging Face model; else the `.gguf` hub.layout picks among its files is served.
    """
    source = check_import_path(local_path, action="load", max_entries=LOAD_SCAN_MAX_ENTRIES)
    if not source.is_dir:
        f = source.files[0]
        if not is_gguf(source.path.name):
            raise HubInputError(f"{local_path} is not a .gguf file: give a .gguf file or a model folder.")
        _check_gguf_magic(local_path, f)
        shards = _shard_files(local_path, f)
        # A split model: the backend finds the siblings by the first shard's name, in its folder.
        serve = f.real if len(shards) == 1 else Path(os.path.realpath(source.path.parent)) / source.path.name
        return LoadSource(path=source.path, format=GGUF, serve=serve, size_bytes=sum(s.size for s in shards))
    sizes = [(f.rel, f.size) for f in source.files]
    if any(f.rel == HF_CONFIG for f in source.files):
        return LoadSource(path=source.path, format=HUGGINGFACE, serve=source.real,
                          size_bytes=weights_size(sizes, HUGGINGFACE))
    rel = pick_gguf(sizes)
    if rel is None:
        raise HubInputError(f"{local_path} holds neither config.json nor a .gguf file.")
    _check_gguf_magic(local_path, next(f for f in source.files if f.rel == rel))
    return LoadSource(path=source.path, format=GGUF, serve=source.real / rel, size_bytes=weights_size(sizes, GGUF))


# --------------------------------------------------------------------------- writing a model
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
                source: dict | None = None, progress: Callable[[int, int], None] | None = None,
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
    return index_prefix(prefix, store=store, source_repo=source_repo, source_revision=source_revision)


def validate_upload(*, local_path: str, format: str, name: str,
                    limit_to_import_dirs: bool = True) -> tuple[str, ImportSource]:
    """Check an upload request before any transfer; returns (prefix, the checked local source)."""
    if format not in FORMAT_ROOTS:
        raise HubInputError(f"Unknown format {format!r}: use gguf or huggingface.")
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


def busy_prefixes() -> set[str]:
    """Model prefixes a live writer holds the lock of now (an upload, a download, the CLI, a delete)."""
    return {prefix for prefix, holder in PrefixLock.objects.values_list("prefix", "holder") if _holder_alive(holder)}


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


# --------------------------------------------------------------------------- upload jobs
def upload_holder(job_id: int) -> str:
    return f"upload:{job_id}"


def create_upload_job(*, local_path: str, format: str, name: str, node: str | None = None, replace: bool = False,
                      user=None, store: ModelStore | None = None) -> UploadJob:
    """Check an upload and queue it for the agent of the node the path is on; the job holds the
    model's write lock from here to its end.

    The node is `node`, or this process's own (settings.NODE_NAME: in `manage.py serve` the web
    server and the one agent are the same node). For a path on this process's node every rule of
    `check_import_path` runs now, so a refusal is a HubInputError before any job exists. For
    another node (a cluster whose web processes run elsewhere) only the path's text can be checked
    here; that node's agent runs the full check, on its own disk, before it reads a byte.
    Raises HubInputError / InvalidPrefix (400), ModelExists or PrefixBusy (409), StoreError (502).
    """
    from hardware.models import Node

    node_name = (node or "").strip() or settings.NODE_NAME
    if format not in FORMAT_ROOTS:
        raise HubInputError(f"Unknown format {format!r}: use gguf or huggingface.")
    prefix = prefix_for(format, name)
    bytes_total = 0
    if node_name == settings.NODE_NAME:
        prefix, source = validate_upload(local_path=local_path, format=format, name=name)
        local_path, bytes_total = str(source.path), sum(f.size for f in source.files)
    else:
        if not Node.objects.filter(name=node_name).exists():
            raise HubInputError(f"No node named {node_name!r}: name a node listed under GPUs, or leave it empty "
                                f"for this server's ({settings.NODE_NAME}).")
        local_path = str(check_path_text(local_path))
    if not replace and (store or get_store()).exists(prefix):
        raise ModelExists(f"{prefix} is already a complete model in the store: upload it under another name, "
                          "or ask to replace it.")
    with transaction.atomic():
        job = UploadJob.objects.create(local_path=local_path, format=format, target_prefix=prefix, replace=replace,
                                       node=node_name, bytes_total=bytes_total, created_by=user)
        lock_prefix(prefix, holder=upload_holder(job.pk))
    return job


def claim_next_upload(*, node_name: str) -> UploadJob | None:
    """Take this node's oldest PENDING upload; a conditional UPDATE makes sure only one agent gets it."""
    pending = UploadJob.objects.filter(status=UploadStatus.PENDING, node=node_name).order_by("created_at", "pk")
    for job_id in pending.values_list("pk", flat=True)[:5]:
        if UploadJob.objects.filter(pk=job_id, status=UploadStatus.PENDING).update(
                status=UploadStatus.UPLOADING, started_at=timezone.now()):
            return UploadJob.objects.get(pk=job_id)
    return None


def update_upload(job_id: int, **fields) -> UploadJob:
    """Write progress of an active upload (a finished one is never changed)."""
    UploadJob.objects.filter(pk=job_id, status__in=UPLOAD_ACTIVE).update(**fields)
    return UploadJob.objects.select_related("created_by").get(pk=job_id)


def finish_upload(job_id: int, *, status: str, error: str = "") -> UploadJob:
    """Move an active upload to COMPLETED, FAILED or CANCELLED and release the model's lock."""
    job = UploadJob.objects.get(pk=job_id)
    UploadJob.objects.filter(pk=job_id, status__in=UPLOAD_ACTIVE).update(
        status=status, error=error[:4000], finished_at=timezone.now())
    unlock_prefix(job.target_prefix, holder=upload_holder(job_id))
    return UploadJob.objects.select_related("created_by").get(pk=job_id)


def execute_upload(job_id: int, *, store: ModelStore | None = None,
                   progress: Callable[[int, int], None] | None = None,
                   cancel: threading.Event | None = None) -> UploadJob:
    """Run a claimed upload (status UPLOADING) to its end, in this thread; returns the final job.

    The node's own rules apply again here (`check_import_path` on this disk: the request may have
    been checked on another host, and files change). Setting `cancel` stops it within a read: it
    ends CANCELLED when a user asked (the job's cancel_requested), else FAILED (the agent stopped).
    Every failure leaves nothing listed as complete (`write_model`).
    """
    job = UploadJob.objects.get(pk=job_id)
    if job.status != UploadStatus.UPLOADING:
        return job
    store = store or get_store()
    kept = f" ({job.target_prefix}, which it was to replace, is unchanged)" if job.replace else ""
    try:
        artifact = upload_local_model(local_path=job.local_path, format=job.format,
                                      name=job.target_prefix.split("/", 1)[1], store=store, progress=progress,
                                      cancel=cancel, replace=job.replace)
    except UploadCancelled:
        if UploadJob.objects.filter(pk=job_id, cancel_requested=True).exists():
            return finish_upload(job_id, status=UploadStatus.CANCELLED,
                                 error=f"Cancelled by a user; nothing of it is listed as complete{kept}.")
        return finish_upload(job_id, status=UploadStatus.FAILED,
                             error=f"The node agent stopped during this upload; nothing of it is listed as "
                                   f"complete{kept}.")
    except (HubInputError, InvalidPrefix, ModelExists, NotARegularFile) as exc:  # the source's fault, or refused
        return finish_upload(job_id, status=UploadStatus.FAILED, error=str(exc))
    except StoreError as exc:
        log.warning("upload %s of %s as %s failed: %s", job_id, job.local_path, job.target_prefix, exc)
        return finish_upload(job_id, status=UploadStatus.FAILED, error=f"The model store failed: {exc}")
    except Exception as exc:
        log.exception("upload %s of %s as %s failed", job_id, job.local_path, job.target_prefix)
        return finish_upload(job_id, status=UploadStatus.FAILED, error=str(exc) or exc.__class__.__name__)
    UploadJob.objects.filter(pk=job_id).update(bytes_done=artifact.size_bytes, bytes_total=artifact.size_bytes)
    return finish_upload(job_id, status=UploadStatus.COMPLETED)


def request_upload_cancel(*, job: UploadJob) -> UploadJob:
    """Ask an upload to stop. One no agent has claimed yet is cancelled (and its lock freed) at once;
    a running one stops at its agent's next look (within a second), and nothing of it stays listed
    as complete."""
    if UploadJob.objects.filter(pk=job.pk, status=UploadStatus.PENDING).update(
            status=UploadStatus.CANCELLED, cancel_requested=True, finished_at=timezone.now(),
            error="Cancelled before it started."):
        unlock_prefix(job.target_prefix, holder=upload_holder(job.pk))
    else:
        UploadJob.objects.filter(pk=job.pk, status__in=UPLOAD_ACTIVE).update(cancel_requested=True)
    return UploadJob.objects.select_related("created_by").get(pk=job.pk)


def fail_orphaned_uploads(*, node_name: str, store: ModelStore | None = None) -> int:
    """Uploads this node's agent was running when it stopped can't be resumed: FAILED with the
    reason, their locks freed, and their prefixes re-indexed (nothing half-written listed complete)."""
    orphans = list(UploadJob.objects.filter(node=node_name, status=UploadStatus.UPLOADING))
    for job in orphans:
        finish_upload(job.pk, status=UploadStatus.FAILED,
                      error="The node agent restarted while this upload ran; nothing of it is listed as complete. "
                            "Upload it again.")
        try:
            after_failed_write(job.target_prefix, store=store or get_store())
        except Exception:
            log.warning("could not re-index %s after its orphaned upload", job.target_prefix, exc_info=True)
    return len(orphans)


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


class NameCollision(ModelExists):
    """A download whose model name (made from its repo id) is held by a model of another origin
    (an upload, or another repo id that makes the same name: `own/rep` and `own_rep`)."""


def check_download_target(target: str, *, repo_id: str, replace: bool, store: ModelStore) -> None:
    """The rule of uploads for a download's target: ModelExists (409 `model_exists`) for a complete
    model unless `replace`; and a download replaces only a model downloaded from the same repo id
    (NameCollision, 409 `name_collision`): names made from repo ids are not one-to-one."""
    manifest = store.read_manifest(target)
    if manifest is None:
        return
    origin = str((manifest.source or {}).get("repo_id") or "")
    if origin != repo_id:
        what = f"a download of {origin}" if origin else "an upload"
        raise NameCollision(f"{target} is already a complete model in the store, from {what}; {repo_id} would "
                            f"take the same name: delete {target} first to download {repo_id} into it.")
    if not replace:
        raise ModelExists(f"{target} is already a complete model in the store (downloaded from {repo_id}): "
                          "download it with replace: true to replace it.")


def create_download_job(*, repo_id: str, revision: str | None = None, format: str,
                        allow_patterns: list[str] | None = None, replace: bool = False, user=None,
                        store: ModelStore | None = None) -> DownloadJob:
    """Queue a Hugging Face download; a hub agent worker claims it. The job holds its target's
    write lock until it ends (PrefixBusy while another upload or download writes that model).
    ModelExists / NameCollision (409) as `check_download_target` says; StoreError (502)."""
    repo_id, revision, format, patterns = validate_download(repo_id=repo_id, revision=revision, format=format,
                                                           allow_patterns=allow_patterns)
    target = prefix_for(format, name_from_repo_id(repo_id))
    check_download_target(target, repo_id=repo_id, replace=replace, store=store or get_store())
    with transaction.atomic():
        job = DownloadJob.objects.create(repo_id=repo_id, revision=revision, format=format, allow_patterns=patterns,
                                         target_prefix=target, replace=replace, created_by=user)
        lock_prefix(target, holder=download_holder(job.pk))  # PrefixBusy: another upload or download of it
    return job


def download_holder(job_id: int) -> str:
    return f"download:{job_id}"


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
        unlock_prefix(job.target_prefix, holder=download_holder(job.pk))
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
        status=status, error=error[:4000], finished_at=timezone.now(), pid=None, pgid=None)
    job = DownloadJob.objects.get(pk=job_id)
    unlock_prefix(job.target_prefix, holder=download_holder(job_id))
    return job


def download_dirs(job_id: int) -> tuple[Path, Path]:
    """The folders one download writes on its node: the files, and the child's HF_HOME."""
    work = Path(settings.DATA_DIR) / "downloads"
    return work / f"job-{job_id}", work / f"job-{job_id}-hfhome"


def _is_download_child(pid: int, job_id: int) -> bool:
    """Whether `pid` is (still) the download child of this job, not a process that took its pid since."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rpartition(b")")[2].split()[0]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, IndexError):
        return False
    dest = str(download_dirs(job_id)[0]).encode()
    return state != b"Z" and b"hub.hf_download" in argv and dest in argv


def stop_download_child(job_id: int, pgid: int | None, *, wait_s: float = 10.0) -> bool:
    """Kill the process group of a download child left by an agent that died (SIGKILL: a download
    cannot be resumed), and wait until it is gone; False when none of it was running."""
    if not pgid or not _is_download_child(pgid, job_id):
        return False
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and _is_download_child(pgid, job_id):
        time.sleep(0.05)
    return True


def fail_orphaned_jobs(*, node_name: str) -> int:
    """Jobs this node had claimed before it restarted can't be resumed: their child processes are
    stopped (they run in their own session and outlive a `kill -9` of the agent), their folders
    removed, the jobs marked FAILED and their locks freed."""
    orphans = DownloadJob.objects.filter(node=node_name, status__in=[DownloadStatus.DOWNLOADING,
                                                                     DownloadStatus.UPLOADING])
    held = list(orphans.values_list("pk", "target_prefix", "pgid"))
    for job_id, _prefix, pgid in held:
        stopped = stop_download_child(job_id, pgid)
        for folder in download_dirs(job_id):
            shutil.rmtree(folder, ignore_errors=True)
        if stopped:
            log.warning("download %s: stopped its child process (group %s), left by the last agent", job_id, pgid)
    count = orphans.update(status=DownloadStatus.FAILED, pid=None, pgid=None, finished_at=timezone.now(),
                           error="The node agent restarted while this download ran: its download process was "
                                 "stopped and its files removed; the model in the store is unchanged.")
    for job_id, prefix, _pgid in held:
        unlock_prefix(prefix, holder=download_holder(job_id))
    _remove_stray_download_dirs()
    return count


def _remove_stray_download_dirs() -> None:
    """Folders under DATA_DIR/downloads of jobs that no longer run (left by an agent that died before
    it had the pid on the job): no job of this node runs while its agent starts."""
    work = Path(settings.DATA_DIR) / "downloads"
    if not work.is_dir():
        return
    active = {f"job-{pk}" for pk in DownloadJob.objects.filter(status__in=DOWNLOAD_ACTIVE).values_list("pk", flat=True)}
    for folder in work.iterdir():
        base = folder.name.removesuffix("-hfhome")
        if folder.name.startswith("job-") and base not in active and folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)
