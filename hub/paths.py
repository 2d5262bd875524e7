"""Store prefixes and the local paths they map to. Every check here runs before any I/O."""
from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

# MANIFEST_NAME is re-exported: the store's manifest, named in hub.layout.
from hub.layout import FORMATS
from hub.layout import MANIFEST_NAME as MANIFEST_NAME

FORMAT_ROOTS = FORMATS  # the store's top-level folders: one per model format, and lora/ for adapters
ROOTS_TEXT = "gguf/, huggingface/ or lora/"

MAX_PREFIX_LEN = 512
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class InvalidPrefix(ValueError):
    """A store prefix (or a model name) that is malformed or tries to leave its root."""


def validate_relative_path(path: str, *, what: str = "path") -> str:
    """A POSIX relative path with no traversal, no empty segment, no control characters."""
    if not isinstance(path, str) or not path:
        raise InvalidPrefix(f"The {what} is empty.")
    if len(path) > MAX_PREFIX_LEN:
        raise InvalidPrefix(f"The {what} is longer than {MAX_PREFIX_LEN} characters.")
    if _CONTROL.search(path):
        raise InvalidPrefix(f"The {what} contains control characters.")
    if "\\" in path:
        raise InvalidPrefix(f"The {what} contains a backslash.")
    if path.startswith("/") or path.startswith("~"):
        raise InvalidPrefix(f"The {what} must be relative, not {path!r}.")
    segments = path.split("/")
    for seg in segments:
        if seg == "":
            raise InvalidPrefix(f"The {what} {path!r} has an empty segment.")
        if seg in (".", ".."):
            raise InvalidPrefix(f"The {what} {path!r} contains a '{seg}' segment.")
    return path


def validate_prefix(prefix: str) -> str:
    """Normalise a store prefix (`gguf/<name>...`, `huggingface/<name>...`, `lora/<name>...`) or
    raise InvalidPrefix.

    A single trailing slash is dropped; anything that could escape the store or the cache
    (`..`, absolute paths, backslashes, empty segments, control characters) is refused.
    """
    if not isinstance(prefix, str):
        raise InvalidPrefix("The model path must be a string.")
    if prefix.endswith("/") and not prefix.endswith("//"):
        prefix = prefix[:-1]
    validate_relative_path(prefix, what="model path")
    root, _, rest = prefix.partition("/")
    if root not in FORMAT_ROOTS:
        raise InvalidPrefix(f"The model path must start with {ROOTS_TEXT}, not {prefix!r}.")
    if not rest:
        raise InvalidPrefix(f"The model path {prefix!r} names no model.")
    return prefix


def format_of(prefix: str) -> str:
    """`gguf`, `huggingface` or `lora` for a validated prefix."""
    return validate_prefix(prefix).split("/", 1)[0]


def validate_name(name: str) -> str:
    """A model name for a new prefix: one path segment of letters, digits, '.', '_', '-'."""
    if not isinstance(name, str) or not _NAME_OK.match(name) or name in (".", ".."):
        raise InvalidPrefix(
            f"Invalid model name {name!r}: use letters, digits, '.', '_' and '-' (one segment, no '/')."
        )
    if ".." in name:
        raise InvalidPrefix(f"Invalid model name {name!r}: '..' is not allowed.")
    return name


def name_from_repo_id(repo_id: str) -> str:
    """`Qwen/Qwen3-4B` -> `Qwen_Qwen3-4B` (a single safe segment)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", repo_id.strip().replace("/", "_"))
    cleaned = cleaned.lstrip("._-") or "model"
    return validate_name(cleaned.replace("..", "_")[:200])


def prefix_for(fmt: str, name: str) -> str:
    """The store prefix of a new model."""
    if fmt not in FORMAT_ROOTS:
        raise InvalidPrefix(f"Unknown format {fmt!r}: use gguf, huggingface or lora.")
    return validate_prefix(f"{fmt}/{validate_name(name)}")


def safe_join(root: Path | str, prefix: str) -> Path:
    """`root/prefix`, guaranteed to stay inside `root` (symlinks resolved)."""
    validate_relative_path(prefix)
    root_path = Path(root).resolve()
    target = (root_path / PurePosixPath(prefix)).resolve()
    if target != root_path and root_path not in target.parents:
        raise InvalidPrefix(f"{prefix!r} escapes {root_path}.")
    return target
