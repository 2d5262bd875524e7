"""The model store: the source of truth for models (MinIO/S3, or a folder as the embedded default).

Layout: `gguf/<name>/...` and `huggingface/<name>/...`. A model is complete only once its
manifest (`<prefix>/.xgen-manifest.json`, the file list with size, ETag and sha256) exists, and
the manifest is always written LAST and deleted FIRST: an interrupted upload or delete never
looks like a loadable model. A write goes to `.xgen-staging/<token>/<prefix>/` first (beside the
format roots, never listed) and is switched in once every file is there, so a replace that is
cancelled or fails leaves the model it was replacing as it was; what a write that died leaves
there is swept at the agent's start (`ModelStore.sweep`).
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import logging
import os
import shutil
import stat
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.utils import timezone

from hub.layout import MANIFEST_NAME, TEMP_SUFFIXES, model_files
from hub.paths import (
    FORMAT_ROOTS,
    InvalidPrefix,
    safe_join,
    validate_prefix,
    validate_relative_path,
)

log = logging.getLogger("xgen.hub.store")

CHUNK = 1024 * 1024
READ_CAP = 8 * 1024 * 1024
S3_MAX_COPY = 5 * 1024**3
MANIFEST_VERSION = 1
PART_SUFFIX = ".xgen-part"  # the filesystem store's file in the making (hub.layout never counts it)
assert PART_SUFFIX in TEMP_SUFFIXES

ByteProgress = Callable[[int], None]  # called with the number of new bytes
# S3 error codes that say "not now" rather than "no" (AWS's retryable ones).
_S3_TRANSIENT = frozenset({"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout"})


class StoreError(RuntimeError):
    """The store could not be reached or refused an operation."""


class ObjectMissing(StoreError):
    """The object named does not exist in the store."""


class StoreUnreachable(StoreError):
    """The store could not be reached or failed on its side (refused, cut, timed out, a 5xx):
    the same request may succeed later, unlike a missing object or a refusal."""


class NotARegularFile(StoreError):
    """A local upload source that is a FIFO, socket or device (or became another file, or went
    away, after its check)."""


class UploadCancelled(StoreError):
    """The upload was told to stop (its cancel event was set) and stopped within a read."""


class ModelExists(RuntimeError):
    """An upload would overwrite a complete model and was not asked to replace it (nothing written)."""


class StoreFull(StoreError):
    """Not enough free space in the store for a write (checked before and during it)."""


class ConcurrentWrite(StoreError):
    """Another writer changed the model's files while this upload ran: its manifest was not written."""


@dataclass(frozen=True)
class StoreObject:
    """One object as the store lists it; `key` is the full key (`gguf/m/file.gguf`)."""

    key: str
    size: int
    etag: str


@dataclass(frozen=True)
class ManifestFile:
    path: str  # relative to the model prefix
    size: int
    etag: str
    sha256: str = ""


@dataclass
class Manifest:
    """What a complete model holds. Written last, after every file is in the store."""

    prefix: str
    format: str
    files: list[ManifestFile]
    created_at: str = ""
    source: dict = field(default_factory=dict)
    version: int = MANIFEST_VERSION

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        body = asdict(self)
        body["size_bytes"] = self.size_bytes
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Manifest:
        data = json.loads(raw)
        files = [
            ManifestFile(path=validate_relative_path(f["path"], what="manifest path"), size=int(f["size"]),
                         etag=str(f.get("etag", "")), sha256=str(f.get("sha256", "")))
            for f in data.get("files", [])
        ]
        return cls(prefix=validate_prefix(data["prefix"]), format=data.get("format", ""), files=files,
                   created_at=data.get("created_at", ""), source=data.get("source") or {},
                   version=int(data.get("version", MANIFEST_VERSION)))


@dataclass
class StoredModel:
    """A model prefix as found by scanning the store."""

    prefix: str
    format: str
    size_bytes: int = 0
    file_count: int = 0
    complete: bool = False
    files: list[dict] = field(default_factory=list)


STAGING_ROOT = ".xgen-staging"  # beside gguf/ and huggingface/: never listed as a model


def staging_prefix(prefix: str) -> str:
    """Where one write of `prefix` puts its files until it switches: unique per write."""
    return f"{STAGING_ROOT}/{uuid.uuid4().hex}/{validate_prefix(prefix)}"


def _staged_prefix(key: str) -> str | None:
    """`.xgen-staging/<token>/gguf/name/...` -> `gguf/name`."""
    parts = key.split("/")
    return f"{parts[2]}/{parts[3]}" if len(parts) >= 4 and parts[0] == STAGING_ROOT else None


def model_prefix_of(key: str) -> str | None:
    """`gguf/name/sub/file` -> `gguf/name`; None for keys outside a model."""
    parts = key.split("/")
    if len(parts) < 3 or parts[0] not in FORMAT_ROOTS:
        return None
    return f"{parts[0]}/{parts[1]}"


@dataclass(frozen=True)
class LocalFile:
    """One file of a local model as the walk found it: its path in the store (`rel`), where the
    walk found it (`path`, maybe a symlink), the file it resolves to (`real`), and that file's
    size and identity, which `open_local` checks again when it opens the file."""

    rel: str
    path: Path
    real: Path
    size: int
    dev: int
    ino: int


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISDIR, "folder")):
        if test(mode):
            return kind
    return "special file"


def _local_file(rel: str, path: Path) -> LocalFile:
    """Stat (never open) one file; a FIFO, socket or device raises NotARegularFile."""
    st = os.stat(path)  # follows a symlink
    if not stat.S_ISREG(st.st_mode):
        through = " (through a symlink)" if path.is_symlink() else ""
        raise NotARegularFile(f"{path} is a {_file_kind(st.st_mode)}{through}, not a regular file.")
    return LocalFile(rel=rel, path=path, real=Path(os.path.realpath(path)), size=st.st_size, dev=st.st_dev,
                     ino=st.st_ino)


def local_files(root: Path, *, limit: int | None = None) -> list[LocalFile]:
    """Every model file under a local folder (or the one file named), found without opening any;
    `limit` bounds the walk (hub.layout.FolderTooLarge past it).

    Symlinked files are followed (`real` says where to); symlinked folders are not walked. A FIFO,
    socket or device anywhere raises NotARegularFile before anything is read or written (a FIFO
    would block the reader forever). Which of these files an upload may read is decided by
    `hub.imports.check_import_path`.
    """
    root = Path(root)
    if not root.is_dir():
        try:
            return [_local_file(root.name, root)]
        except FileNotFoundError:
            return []
    out: list[LocalFile] = []
    for rel, path in model_files(root, limit=limit):  # which files are the model: hub.layout
        try:
            out.append(_local_file(rel, path))
        except FileNotFoundError:  # a dangling symlink, or gone since the listing
            continue
    return out


def open_local(local: LocalFile | Path) -> BinaryIO:
    """Open a local file for upload: never blocks on a FIFO, reads only a regular file, and for a
    LocalFile only the very file its walk checked (same device and inode, final symlink refused)."""
    checked = local if isinstance(local, LocalFile) else None
    path = local.real if isinstance(local, LocalFile) else Path(local)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if checked else 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise NotARegularFile(f"{checked.path if checked else path} went away after it was checked; "
                              "upload it again.") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(f"{path} is a {_file_kind(st.st_mode)}, not a regular file.")
        if checked and (st.st_dev, st.st_ino) != (checked.dev, checked.ino):
            raise NotARegularFile(f"{checked.path} was replaced after it was checked; upload it again.")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class _HashingReader(io.RawIOBase):
    """Wraps a file: hashes (sha256) and reports every byte as the uploader reads it."""

    def __init__(self, fh: BinaryIO, progress: ByteProgress | None, cancel: threading.Event | None) -> None:
        self._fh = fh
        self.sha = hashlib.sha256()
        self._progress = progress
        self._cancel = cancel

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if self._cancel is not None and self._cancel.is_set():
            raise UploadCancelled("upload cancelled")
        # Capped so progress and cancel act within a part (the SDK would read 64 MiB at once).
        size = READ_CAP if size is None or size < 0 else min(size, READ_CAP)
        data = self._fh.read(size)
        self.sha.update(data)
        if data and self._progress:
            self._progress(len(data))
        return data


def _is_what_was_written(obj: StoreObject | None, entry: ManifestFile) -> bool:
    """The object listed now is the one this upload put (same size and, where known, ETag)."""
    return obj is not None and obj.size == entry.size and (not entry.etag or not obj.etag or obj.etag == entry.etag)


class ModelStore(ABC):
    """What every store does. Implementations pass the same contract suite (tests/hub)."""

    kind = "store"
    renames = False  # whether a folder of objects moves at no cost (a switch is a rename, not copies)

    # ---- primitives each implementation provides
    @abstractmethod
    def iter_objects(self, prefix: str) -> Iterator[StoreObject]:
        """Every object whose key starts with `prefix` (recursive, sorted by key)."""

    @abstractmethod
    def put_file(self, key: str, local: LocalFile | Path, *, progress: ByteProgress | None = None,
                 cancel: threading.Event | None = None) -> tuple[StoreObject, str]:
        """Upload one file (opened with `open_local`); returns the stored object and the file's sha256."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> StoreObject:
        """Write a small object in one request."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read a small object; ObjectMissing if absent."""

    @abstractmethod
    def get_head(self, key: str, length: int) -> bytes:
        """The first `length` bytes of an object (all of a shorter one), in one ranged request;
        ObjectMissing if absent."""

    @abstractmethod
    def stream_to(self, key: str, fh: BinaryIO, *, on_chunk: Callable[[bytes], None]) -> str:
        """Copy an object into `fh` with ONE request, calling on_chunk per chunk; returns its ETag."""

    @abstractmethod
    def delete_keys(self, keys: list[str]) -> None:
        """Delete objects (missing ones are ignored)."""

    @abstractmethod
    def describe(self) -> str:
        """Where the store is, for logs and pages (never a secret)."""

    # ---- the model layer, shared by every implementation
    def read_manifest(self, prefix: str) -> Manifest | None:
        """The model's manifest, or None while the model is incomplete."""
        prefix = validate_prefix(prefix)
        try:
            raw = self.get_bytes(f"{prefix}/{MANIFEST_NAME}")
        except ObjectMissing:
            return None
        try:
            return Manifest.from_json(raw)
        except (ValueError, KeyError, InvalidPrefix) as exc:
            log.warning("unreadable manifest for %s: %s", prefix, exc)
            return None

    def list_files(self, prefix: str) -> list[StoreObject]:
        """The model's objects, manifest excluded."""
        prefix = validate_prefix(prefix)
        return [o for o in self.iter_objects(prefix + "/") if o.key != f"{prefix}/{MANIFEST_NAME}"]

    def scan_models(self, *, formats: tuple[str, ...] = FORMAT_ROOTS) -> list[StoredModel]:
        """Every model prefix in the store with size, file count and completeness (one listing per format)."""
        models: dict[str, StoredModel] = {}
        for fmt in formats:
            for obj in self.iter_objects(fmt + "/"):
                prefix = model_prefix_of(obj.key)
                if prefix is None:
                    continue
                model = models.get(prefix)
                if model is None:
                    model = models[prefix] = StoredModel(prefix=prefix, format=fmt)
                rel = obj.key[len(prefix) + 1 :]
                if rel == MANIFEST_NAME:
                    model.complete = True
                    continue
                model.size_bytes += obj.size
                model.file_count += 1
                model.files.append({"path": rel, "size": obj.size, "etag": obj.etag})
        return sorted(models.values(), key=lambda m: m.prefix)

    def exists(self, prefix: str) -> bool:
        """True when the model is complete (its manifest exists)."""
        return self.read_manifest(prefix) is not None

    def upload_model(
        self,
        prefix: str,
        local: Path,
        *,
        files: list[LocalFile] | None = None,
        source: dict | None = None,
        progress: Callable[[int, int], None] | None = None,
        cancel: threading.Event | None = None,
        replace: bool = False,
    ) -> Manifest:
        """Upload a local folder (or one file) as `prefix`; the manifest goes last.

        `files` is the walk of `local` already checked by `hub.imports.check_import_path` (every
        upload a user asks for comes that way); without it `local` is walked here, for the
        console's own callers (the demo model, tests).
        A complete model is overwritten only with `replace=True` (else ModelExists, nothing
        written). The files go to a staging prefix and are switched in once all are there
        (`switch_to_staged`): the model as it was stays complete and loadable until then, and a
        cancel or failure leaves it untouched. A store without a rename (S3) writes a model it does
        not hold yet in place instead (nothing to keep, and no copy to pay), manifest last, and
        removes what it wrote when it fails. The manifest lists only what this upload wrote: each
        file is checked in the store (size and ETag) first, and a file another writer removed or
        replaced meanwhile fails the upload (ConcurrentWrite) with no manifest written. (One
        writer per prefix is the job of the console's lock, `hub.locks.lock_prefix`.)
        """
        prefix = validate_prefix(prefix)
        if files is None:
            files = local_files(Path(local))
        if not files:
            raise StoreError(f"{local} holds no files to upload.")
        existing = self.exists(prefix)
        if existing and not replace:
            raise ModelExists(f"{prefix} is already a complete model in the store; replace it explicitly "
                              "or upload under another name.")
        total = sum(f.size for f in files)  # apparent sizes: a sparse file is written out in full
        self.check_room(prefix, total)
        done = 0
        lock = threading.Lock()

        def on_bytes(n: int) -> None:
            nonlocal done
            with lock:
                done += n
                if progress:
                    progress(done, total)

        in_place = not existing and not self.renames
        staging = prefix if in_place else staging_prefix(prefix)
        ready = switched = False
        try:
            entries: list[ManifestFile] = []
            for f in files:
                self.check_room(prefix, total - done)  # another writer may have taken the space meanwhile
                obj, sha = self.put_file(f"{staging}/{f.rel}", f, progress=on_bytes, cancel=cancel)
                entries.append(ManifestFile(path=f.rel, size=obj.size, etag=obj.etag, sha256=sha))
            listed = {o.key: o for o in self.iter_objects(staging + "/")}
            changed = [e.path for e in entries if not _is_what_was_written(listed.get(f"{staging}/{e.path}"), e)]
            if changed:
                raise ConcurrentWrite(f"{prefix} was changed by another writer while this upload ran "
                                      f"({', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''} gone or "
                                      "replaced): its manifest was not written; upload it again.")
            if not replace and self.exists(prefix):
                raise ConcurrentWrite(f"{prefix} was completed by another writer while this upload ran: "
                                      "its manifest was not written; upload it again, or replace it.")
            manifest = Manifest(prefix=prefix, format=prefix.split("/", 1)[0], files=entries,
                                created_at=timezone.now().isoformat(), source=source or {})
            if in_place:
                keep = {f"{prefix}/{e.path}" for e in entries}
                stale = [key for key in listed if key not in keep]  # left by an earlier write that died
                if stale:
                    self.delete_keys(stale)
                self.put_bytes(f"{prefix}/{MANIFEST_NAME}", manifest.to_json())
                ready = switched = True
                return manifest
            # Ready to switch: a switch cut short from here on is finished later (`finish_switches`),
            # never undone, so the store keeps one complete version of the model or the other.
            self.put_bytes(f"{staging}/{MANIFEST_NAME}", manifest.to_json())
            ready = True
            manifest = self.switch_to_staged(staging, manifest)
            switched = True
            for other, _ in self.staged_switches(prefix):  # older cut-short switches: this one is newer
                if other != staging:
                    self.drop_staging(other)
            return manifest
        finally:
            try:
                if in_place and not switched and not self.exists(prefix):
                    self.delete_model(prefix)  # no complete model was there: what this write left goes
                elif not in_place and (switched or not ready):
                    self.drop_staging(staging)
            except Exception as exc:  # never hides the write's own outcome; the next sweep removes it
                log.warning("could not remove what the write of %s left at %s: %s", prefix, staging, exc)

    # ---- writing beside the model, then switching (issue 34 #10)
    def check_room(self, prefix: str, need: int) -> None:
        """Refuse (StoreFull) a write of `need` more bytes that cannot fit; a store that cannot
        tell (S3) lets the write go on and answers its own error."""
        return None

    def switch_to_staged(self, staging: str, manifest: Manifest) -> Manifest:
        """Make the files written under `staging` the model `manifest.prefix`, manifest last; until
        this runs the model as it was (complete or not) is untouched. S3 has no rename: each object
        is copied in the store (no byte through the console), stale ones removed, the manifest
        written; the old manifest goes first, so a reader sees the old model until the switch,
        then briefly nothing loadable, then the new one."""
        prefix = manifest.prefix
        manifest_key = f"{prefix}/{MANIFEST_NAME}"
        old = [o.key for o in self.iter_objects(prefix + "/")]
        self.delete_keys([manifest_key])
        final: list[ManifestFile] = []
        for entry in manifest.files:
            obj = self.copy_key(f"{staging}/{entry.path}", f"{prefix}/{entry.path}", size=entry.size)
            final.append(dataclasses.replace(entry, etag=obj.etag))
        keep = {f"{prefix}/{e.path}" for e in final} | {manifest_key}
        stale = [key for key in old if key not in keep]
        if stale:
            self.delete_keys(stale)
        manifest = dataclasses.replace(manifest, files=final)
        self.put_bytes(manifest_key, manifest.to_json())
        return manifest

    def copy_key(self, src: str, dest: str, *, size: int) -> StoreObject:
        """Copy one object to another key inside the store (stores without a rename)."""
        raise NotImplementedError

    def staged_switches(self, prefix: str | None = None) -> list[tuple[str, Manifest]]:
        """(staging prefix, manifest) of writes that wrote every file and their manifest and were cut
        short in their switch (the store went away mid-copy, a `kill -9`), oldest first."""
        found = []
        for obj in self.iter_objects(STAGING_ROOT + "/"):
            target = _staged_prefix(obj.key)
            staging = obj.key[: -len(MANIFEST_NAME) - 1]
            if target is None or (prefix and target != prefix) or staging.count("/") != 3 \
                    or not obj.key.endswith("/" + MANIFEST_NAME):
                continue
            try:
                manifest = Manifest.from_json(self.get_bytes(obj.key))
            except (ObjectMissing, ValueError, KeyError, InvalidPrefix):
                continue
            if manifest.prefix == target:
                found.append((staging, manifest))
        return sorted(found, key=lambda item: item[1].created_at)

    def finish_switches(self, *, busy: Callable[[], set[str]]) -> list[str]:
        """Finish the switches cut short (`staged_switches`) of models no writer holds now (the
        newest write of each wins); returns the prefixes switched."""
        pending = self.staged_switches()
        held = busy() if pending else set()
        newest = {manifest.prefix: (staging, manifest) for staging, manifest in pending if manifest.prefix not in held}
        for staging, manifest in newest.values():
            self.switch_to_staged(staging, manifest)
        for staging, manifest in pending:
            if manifest.prefix in newest:
                self.drop_staging(staging)
        return sorted(newest)

    def drop_staging(self, staging: str) -> None:
        """Remove what a write left under its staging prefix (nothing, once switched)."""
        keys = [o.key for o in self.iter_objects(staging + "/")]
        if keys:
            self.delete_keys(keys)

    def sweep(self, *, busy: Callable[[], set[str]]) -> list[str]:
        """Remove what writes that died (a `kill -9`) left behind: staging areas, partial files,
        incomplete multipart uploads; never those of a model prefix in `busy()` (a writer holds it
        now; asked after the listing, so a write that began meanwhile is spared). Returns what went."""
        found = list(self.iter_objects(STAGING_ROOT + "/"))
        held = busy()
        removed = [obj.key for obj in found if _staged_prefix(obj.key) not in held]
        if removed:
            self.delete_keys(removed)
        return removed

    def delete_model(self, prefix: str) -> int:
        """Delete a model (manifest first); returns how many objects were removed."""
        prefix = validate_prefix(prefix)
        manifest_key = f"{prefix}/{MANIFEST_NAME}"
        self.delete_keys([manifest_key])
        keys = [o.key for o in self.iter_objects(prefix + "/")]
        if keys:
            self.delete_keys(keys)
        return len(keys)


# --------------------------------------------------------------------------- MinIO / S3
class MinioModelStore(ModelStore):
    """S3 through the minio SDK; the bucket is created when missing."""

    kind = "minio"

    def __init__(self, *, endpoint: str, access_key: str, secret_key: str, bucket: str,
                 secure: bool = False, max_connections: int | None = None) -> None:
        import urllib3
        from minio import Minio

        self.endpoint = endpoint
        self.bucket = bucket
        pool = max(10, 2 * (max_connections or settings.CACHE_SYNC_WORKERS))
        http = urllib3.PoolManager(
            maxsize=pool,
            timeout=urllib3.Timeout(connect=min(5, settings.STORE_TIMEOUT_S), read=settings.STORE_TIMEOUT_S),
            retries=urllib3.Retry(total=2, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
        )
        self.client = Minio(endpoint, access_key=access_key or None, secret_key=secret_key or None,
                            secure=secure, http_client=http)
        self._bucket_ready = False
        self._bucket_lock = threading.Lock()

    def describe(self) -> str:
        return f"s3://{self.endpoint}/{self.bucket}"

    def _ensure_bucket(self) -> None:
        if self._bucket_ready:
            return
        with self._bucket_lock:
            if self._bucket_ready:
                return
            try:
                if not self.client.bucket_exists(self.bucket):
                    self.client.make_bucket(self.bucket)
            except Exception as exc:
                raise self._wrap(exc, "bucket") from exc
            self._bucket_ready = True

    def _wrap(self, exc: Exception, key: str) -> StoreError:
        import urllib3
        from minio.error import InvalidResponseError, S3Error, ServerError

        if isinstance(exc, S3Error) and exc.code in ("NoSuchKey", "NoSuchBucket"):
            return ObjectMissing(f"{key} is not in the store")
        message = f"store {self.describe()} failed on {key}: {exc.__class__.__name__}: {exc}"
        status = getattr(getattr(exc, "response", None), "status", 0) or 0
        if (isinstance(exc, (urllib3.exceptions.HTTPError, OSError, ServerError, InvalidResponseError))
                or (isinstance(exc, S3Error) and (status >= 500 or exc.code in _S3_TRANSIENT))):
            return StoreUnreachable(message)
        return StoreError(message)

    def iter_objects(self, prefix: str) -> Iterator[StoreObject]:
        self._ensure_bucket()
        try:
            for obj in self.client.list_objects(self.bucket, prefix=prefix, recursive=True):
                if obj.is_dir:
                    continue
                yield StoreObject(key=obj.object_name, size=int(obj.size or 0), etag=(obj.etag or "").strip('"'))
        except StoreError:
            raise
        except Exception as exc:
            raise self._wrap(exc, prefix) from exc

    def put_file(self, key, local, *, progress=None, cancel=None):
        self._ensure_bucket()
        with open_local(local) as fh:
            size = os.fstat(fh.fileno()).st_size
            reader = _HashingReader(fh, progress, cancel)
            try:
                # minio annotates a BinaryIO; it calls read(n) only, all _HashingReader has
                result = self.client.put_object(self.bucket, key, reader, length=size,  # type: ignore[arg-type]
                                                part_size=64 * 1024 * 1024)
            except StoreError:  # raised by the reader: a cancel, not the store's fault
                raise
            except Exception as exc:
                raise self._wrap(exc, key) from exc
        return StoreObject(key=key, size=size, etag=(result.etag or "").strip('"')), reader.sha.hexdigest()

    def put_bytes(self, key: str, data: bytes) -> StoreObject:
        self._ensure_bucket()
        try:
            result = self.client.put_object(self.bucket, key, io.BytesIO(data), length=len(data),
                                            content_type="application/json")
        except Exception as exc:
            raise self._wrap(exc, key) from exc
        return StoreObject(key=key, size=len(data), etag=(result.etag or "").strip('"'))

    def get_bytes(self, key: str) -> bytes:
        return self._read(key)

    def get_head(self, key: str, length: int) -> bytes:
        return self._read(key, length=max(1, length))

    def _read(self, key: str, length: int = 0) -> bytes:
        """An object's bytes (its first `length` when given: a ranged GET), in one request."""
        self._ensure_bucket()
        response = None
        try:
            response = self.client.get_object(self.bucket, key, offset=0, length=length)
            return response.read()
        except Exception as exc:
            raise self._wrap(exc, key) from exc
        finally:
            if response is not None:
                response.close()
                response.release_conn()

    def stream_to(self, key, fh, *, on_chunk):
        self._ensure_bucket()
        response = None
        try:
            response = self.client.get_object(self.bucket, key)
            etag = (response.headers.get("ETag") or "").strip('"')
            for chunk in response.stream(CHUNK):
                fh.write(chunk)
                on_chunk(chunk)
            return etag
        except StoreError:
            raise
        except Exception as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            import urllib3
            from minio.error import S3Error

            if isinstance(exc, (S3Error, urllib3.exceptions.HTTPError, OSError)):
                raise self._wrap(exc, key) from exc
            raise
        finally:
            if response is not None:
                response.close()
                response.release_conn()

    def copy_key(self, src: str, dest: str, *, size: int) -> StoreObject:
        from minio.commonconfig import ComposeSource, CopySource

        self._ensure_bucket()
        try:
            if size > S3_MAX_COPY:  # one CopyObject copies at most 5 GiB; above it, a multipart copy
                result = self.client.compose_object(self.bucket, dest, [ComposeSource(self.bucket, src)])
            else:
                result = self.client.copy_object(self.bucket, dest, CopySource(self.bucket, src))
        except Exception as exc:
            raise self._wrap(exc, dest) from exc
        return StoreObject(key=dest, size=size, etag=(result.etag or "").strip('"'))

    def incomplete_uploads(self, prefix: str) -> list[tuple[str, str]]:
        """(key, upload id) of the multipart uploads under `prefix` that were begun and never
        completed or aborted (a `kill -9` mid-part): the store keeps their parts, unlisted."""
        self._ensure_bucket()
        found: list[tuple[str, str]] = []
        key_marker = upload_marker = None
        try:
            while True:  # the SDK has no public listing of these; its own request helpers do it
                page = self.client._list_multipart_uploads(self.bucket, prefix=prefix, key_marker=key_marker,
                                                           upload_id_marker=upload_marker, max_uploads=1000)
                found += [(u.object_name, u.upload_id) for u in page.uploads if u.upload_id]  # S3 always names it
                if not page.is_truncated or not page.next_key_marker or page.next_key_marker == key_marker:
                    return found
                key_marker, upload_marker = page.next_key_marker, page.next_upload_id_marker
        except Exception as exc:
            raise self._wrap(exc, prefix) from exc

    def abort_incomplete(self, prefix: str, *, busy: Callable[[], set[str]] = set) -> list[str]:
        """Abort the incomplete multipart uploads under `prefix` (not those of a model in `busy()`)."""
        aborted = []
        found = self.incomplete_uploads(prefix)
        held = busy() if found else set()
        for key, upload_id in found:
            if model_prefix_of(key) in held or _staged_prefix(key) in held:
                continue
            try:
                self.client._abort_multipart_upload(self.bucket, key, upload_id)
            except Exception as exc:
                raise self._wrap(exc, key) from exc
            aborted.append(key)
        return aborted

    def delete_model(self, prefix: str) -> int:
        removed = super().delete_model(prefix)
        self.abort_incomplete(validate_prefix(prefix) + "/")
        return removed

    def sweep(self, *, busy: Callable[[], set[str]]) -> list[str]:
        removed = super().sweep(busy=busy)
        for root in (*FORMAT_ROOTS, STAGING_ROOT):
            removed += [f"{key} (incomplete upload)" for key in self.abort_incomplete(root + "/", busy=busy)]
        return removed

    def delete_keys(self, keys: list[str]) -> None:
        from minio.deleteobjects import DeleteObject

        if not keys:
            return
        self._ensure_bucket()
        try:
            for start in range(0, len(keys), 1000):
                errors = list(self.client.remove_objects(self.bucket, [DeleteObject(k) for k in keys[start:start + 1000]]))
                if errors:
                    raise StoreError(f"could not delete {len(errors)} objects: {errors[0]}")
        except StoreError:
            raise
        except Exception as exc:
            raise self._wrap(exc, keys[0]) from exc


# --------------------------------------------------------------------------- filesystem
class FilesystemModelStore(ModelStore):
    """A folder as the store (the embedded default). ETag = mtime and size, like a web server's."""

    kind = "filesystem"
    renames = True

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root or settings.STORE_DIR).resolve()

    def describe(self) -> str:
        return f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return safe_join(self.root, key)

    def iter_objects(self, prefix: str) -> Iterator[StoreObject]:
        base = self.root
        if not base.is_dir():
            return
        # Walk only the folder that can hold keys with this prefix.
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = safe_join(base, head) if head else base
        if not start.is_dir():
            return
        found: list[StoreObject] = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames.sort()
            for name in filenames:
                if name.endswith(PART_SUFFIX):
                    continue
                path = Path(dirpath) / name
                key = path.relative_to(base).as_posix()
                if not key.startswith(prefix):
                    continue
                st = path.stat()
                found.append(StoreObject(key=key, size=st.st_size, etag=f"{st.st_mtime_ns:x}-{st.st_size:x}"))
        yield from sorted(found, key=lambda o: o.key)

    def _etag(self, path: Path) -> str:
        st = path.stat()
        return f"{st.st_mtime_ns:x}-{st.st_size:x}"

    def put_file(self, key, local, *, progress=None, cancel=None):
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{dest.name}.{uuid.uuid4().hex[:8]}{PART_SUFFIX}")
        src = open_local(local)  # a local file's fault is not the store's: raised as it is
        try:
            with src, open(tmp, "wb") as out:
                reader = _HashingReader(src, progress, cancel)
                while chunk := reader.read(CHUNK):
                    out.write(chunk)
            os.replace(tmp, dest)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise StoreFull(f"the store's disk ({self.root}) filled up while writing {key}; the model in "
                                "the store is unchanged") from exc
            raise StoreError(f"store {self.describe()} failed on {key}: {exc}") from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return StoreObject(key=key, size=dest.stat().st_size, etag=self._etag(dest)), reader.sha.hexdigest()

    def put_bytes(self, key: str, data: bytes) -> StoreObject:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{dest.name}.{uuid.uuid4().hex[:8]}{PART_SUFFIX}")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
        return StoreObject(key=key, size=len(data), etag=self._etag(dest))

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectMissing(f"{key} is not in the store") from None

    def get_head(self, key: str, length: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read(max(1, length))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectMissing(f"{key} is not in the store") from None

    def stream_to(self, key, fh, *, on_chunk):
        path = self._path(key)
        try:
            src = open(path, "rb")  # noqa: SIM115
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectMissing(f"{key} is not in the store") from None
        with src:
            etag = self._etag(path)
            while chunk := src.read(CHUNK):
                fh.write(chunk)
                on_chunk(chunk)
        return etag

    def delete_keys(self, keys: list[str]) -> None:
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            # Drop folders left empty, up to the format root.
            parent = path.parent
            while parent != self.root and parent.parent != self.root:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

    def remove_tree(self, prefix: str) -> None:
        """Remove a model folder outright (used after delete_model to drop leftovers)."""
        shutil.rmtree(self._path(validate_prefix(prefix)), ignore_errors=True)

    def delete_model(self, prefix: str) -> int:
        """As every store, then the folder itself: partial files of a write that died go too."""
        removed = super().delete_model(prefix)
        self.remove_tree(prefix)
        return removed

    def check_room(self, prefix: str, need: int) -> None:
        free = _free_bytes(self.root)
        if need > free:
            raise StoreFull(f"not enough free space in the store for {prefix}: {need / 2**20:.1f} MiB to write "
                            f"(the files' apparent size), {free / 2**20:.1f} MiB free in {self.root}; the model "
                            "in the store is unchanged")

    def switch_to_staged(self, staging: str, manifest: Manifest) -> Manifest:
        """Two renames on one disk: the old folder out of the way, the new one in; then the old removed."""
        new, dest = self._path(staging), self._path(manifest.prefix)
        old = new.parent.parent.parent / f"{new.parent.parent.name}.old"  # .xgen-staging/<token>.old
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(dest, old)
            replaced = True
        except FileNotFoundError:
            replaced = False
        os.rename(new, dest)
        if replaced:
            shutil.rmtree(old, ignore_errors=True)
        return manifest

    def drop_staging(self, staging: str) -> None:
        shutil.rmtree(self._path(staging).parent.parent, ignore_errors=True)  # .xgen-staging/<token>

    def sweep(self, *, busy: Callable[[], set[str]]) -> list[str]:
        removed = []
        staging_root = self.root / STAGING_ROOT
        tokens = sorted(staging_root.iterdir()) if staging_root.is_dir() else []
        parts = [Path(d) / name for fmt in FORMAT_ROOTS if (self.root / fmt).is_dir()
                 for d, _dirs, names in os.walk(self.root / fmt) for name in names if name.endswith(PART_SUFFIX)]
        live = busy()
        for token in tokens:  # .xgen-staging/<token>/<format>/<name>, or <token>.old mid-switch
            try:
                staged = {f"{fmt.name}/{name.name}" for fmt in token.iterdir() if fmt.is_dir()
                          for name in fmt.iterdir()} if token.is_dir() and not token.is_symlink() else set()
            except OSError:  # removed meanwhile (a write that just switched)
                continue
            if staged & live:
                continue
            removed.append(token.relative_to(self.root).as_posix())
            if token.is_dir() and not token.is_symlink():
                shutil.rmtree(token, ignore_errors=True)
            else:
                token.unlink(missing_ok=True)
        for path in parts:  # a write of the filesystem store before staging, or one that died mid-file
            key = path.relative_to(self.root).as_posix()
            if model_prefix_of(key) not in live:
                path.unlink(missing_ok=True)
                removed.append(key)
        return removed


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def get_store() -> ModelStore:
    """MinIO when MINIO_ENDPOINT is set, else the filesystem store under STORE_DIR."""
    if settings.MINIO_ENDPOINT:
        return MinioModelStore(
            endpoint=settings.MINIO_ENDPOINT,
            access_key=settings.MINIO_ACCESS_KEY or "",
            secret_key=settings.MINIO_SECRET_KEY or "",
            bucket=settings.MINIO_BUCKET,
            secure=settings.MINIO_SECURE,
        )
    return FilesystemModelStore(settings.STORE_DIR)
