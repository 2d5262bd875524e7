"""Local paths the console may read: what an upload copies into the store and what a load serves
from a node's disk (under XGEN_IMPORT_DIRS, never the console's own folders or database)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

from hub.layout import GGUF, HF_CONFIG, HUGGINGFACE, FolderTooLarge, is_gguf, pick_gguf, weights_size
from hub.paths import InvalidPrefix, validate_relative_path
from hub.store import LocalFile, NotARegularFile, local_files, open_local


class HubInputError(ValueError):
    """Input that the API answers with 400 (message is shown to the user)."""


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
    rules: _Rules | None = field(default=None, repr=False, compare=False)  # what it was checked under


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


@dataclass(frozen=True)
class _Rules:
    """Where a check may read: XGEN_IMPORT_DIRS resolved (None: anywhere, `manage.py hub_upload`)
    and the console's own paths (`console_paths`). Resolved once per check: a split GGUF's shards
    are checked under the rules its first file was."""

    import_dirs: list[Path] | None
    own: list[tuple[str, Path]]


def _rules(*, limit_to_import_dirs: bool, action: str) -> _Rules:
    import_dirs = None
    if limit_to_import_dirs:
        import_dirs = [Path(os.path.realpath(d)) for d in settings.IMPORT_DIRS]
        if not import_dirs:
            raise HubInputError(f"{action.capitalize()}s from local paths are off on this server: set "
                                f"XGEN_IMPORT_DIRS to the folders (comma separated) that {action}s may read from.")
    return _Rules(import_dirs=import_dirs, own=console_paths())


def check_import_path(local_path: str, *, limit_to_import_dirs: bool = True, action: str = "upload",
                      max_entries: int | None = None, rules: _Rules | None = None) -> ImportSource:
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
    rules = rules or _rules(limit_to_import_dirs=limit_to_import_dirs, action=action)
    import_dirs, own = rules.import_dirs, rules.own
    real = Path(os.path.realpath(path))
    via = f" (it leads to {real})" if real != path else ""
    if not _allowed(real, import_dirs):
        raise HubInputError(f"{local_path}{via} is not under XGEN_IMPORT_DIRS "
                            f"({', '.join(str(d) for d in import_dirs or [])}): {action}s read only from those folders.")
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
    return ImportSource(path=path, real=real, is_dir=is_dir, files=files, rules=rules)


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


def _shard_files(local_path: str, f: LocalFile, rules: _Rules | None) -> list[LocalFile]:
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
            out += check_import_path(str(sibling), action="load", rules=rules).files
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
        shards = _shard_files(local_path, f, source.rules)
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


__all__ = ["LOAD_SCAN_MAX_ENTRIES", "UPLOAD_SCAN_MAX_ENTRIES", "HubInputError", "ImportSource", "LoadSource",
           "check_import_path", "check_load_path", "check_path_text", "console_paths"]
