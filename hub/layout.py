"""What a model folder looks like: the one place that says so.

A model is a folder (in the store under `gguf/<name>/` or `huggingface/<name>/`, on a node under
MODELS_DIR/<prefix>, or anywhere on a node's disk) or a single `.gguf` file. These rules decide:
- which files of a folder are the model (`model_files`): everything but the manifests, VCS and
  download-tool folders, and the temporary files of an unfinished copy;
- which file a GGUF backend loads (`gguf_to_serve`): the first shard of a split model, else the
  largest `.gguf` (a vision projector `mmproj-*.gguf` only when it is the only one);
- what makes a Hugging Face folder (`hf_root`, `is_hf_folder`): a `config.json`, at the top or,
  for a nested snapshot, the shallowest one;
- how big the weights are (`weights_bytes`): the GGUF file with its sibling shards, or a Hugging
  Face folder's `*.safetensors` (its `*.bin`/`*.pt` weights when it has none);
- whether a local source fits a format before an upload (`layout_problem`);
- what a LoRA adapter is (`lora/<name>/` in the store, issue 27): a GGUF adapter file (for a GGUF
  base on llama.cpp) or a PEFT folder, `adapter_config.json` at its top (for a Hugging Face base on
  vLLM); `lora_base_format` says which base it goes with, `lora_to_serve` what the engine loads.
It imports nothing of the project, so every layer (the store, the node cache, serving) can use it.
The pure functions take relative POSIX paths (a manifest's or a walk's); the Path ones look at a
local disk.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath

GGUF = "gguf"
HUGGINGFACE = "huggingface"
LORA = "lora"
FORMATS = (GGUF, HUGGINGFACE, LORA)  # the store's top-level folders
MODEL_FORMATS = (GGUF, HUGGINGFACE)  # what loads as a model (a LoRA adapter loads with its base)
PEFT_CONFIG = "adapter_config.json"

MANIFEST_NAME = ".xgen-manifest.json"  # in the store: written last, deleted first
CACHE_MANIFEST_NAME = ".xgen-cache.json"  # on a node: the record of the last verified sync
HF_CONFIG = "config.json"
GGUF_SUFFIX = ".gguf"
# Folders a local model folder may hold that are never part of the model.
SKIPPED_DIRS = frozenset({".cache", ".git", ".locks"})
# Temporary files of a copy in progress (ours: `.xgen-part`, `.part`; Hugging Face's `.incomplete`).
TEMP_SUFFIXES = (".xgen-part", ".part", ".lock", ".incomplete")
WEIGHT_SUFFIXES = (".safetensors",)
FALLBACK_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth")

_SHARD_RE = re.compile(r"-(\d+)-of-(\d+)\.gguf$")
_FIRST_SHARD_RE = re.compile(r"-0*1-of-\d+\.gguf$")


# ---------------------------------------------------------------- which files are the model
def is_model_file(rel: str) -> bool:
    """Whether a file at `rel` (relative to the model folder) belongs to the model."""
    parts = PurePosixPath(rel).parts
    if not parts or any(p in SKIPPED_DIRS for p in parts[:-1]):
        return False
    name = parts[-1]
    return name not in (MANIFEST_NAME, CACHE_MANIFEST_NAME) and not name.endswith(TEMP_SUFFIXES)


class FolderTooLarge(ValueError):
    """A folder holds more entries than a bounded walk may look at (`model_files(limit=)`)."""


def model_files(root: Path, *, limit: int | None = None) -> Iterator[tuple[str, Path]]:
    """(relative path, path) of every model file under a local folder, sorted, nothing opened or
    stat'ed. Symlinked folders are not walked; skipped folders are not entered. With `limit`, the
    walk looks at no more than that many entries (files and folders, skipped ones included) and
    raises FolderTooLarge past it, however large one folder is (a web request never walks `/usr`)."""
    root = Path(root)
    seen = 0

    def walk(folder: Path) -> Iterator[tuple[str, Path]]:
        nonlocal seen
        files: list[str] = []
        dirs: list[str] = []
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    seen += 1
                    if limit is not None and seen > limit:
                        raise FolderTooLarge(f"{root} holds more than {limit} files and folders")
                    try:
                        is_dir = entry.is_dir()
                    except OSError:
                        is_dir = False
                    if not is_dir:
                        files.append(entry.name)
                    elif not entry.is_symlink() and entry.name not in SKIPPED_DIRS:
                        dirs.append(entry.name)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return  # as os.walk: a folder that cannot be listed is skipped
        for name in sorted(files):
            path = folder / name
            rel = path.relative_to(root).as_posix()
            if is_model_file(rel):
                yield rel, path
        for name in sorted(dirs):
            yield from walk(folder / name)

    yield from walk(root)


# ---------------------------------------------------------------- GGUF
def is_gguf(rel: str) -> bool:
    return rel.endswith(GGUF_SUFFIX)


def _is_projector(rel: str) -> bool:
    return PurePosixPath(rel).name.lower().startswith("mmproj")


def pick_gguf(files: Iterable[tuple[str, int]]) -> str | None:
    """Of (relative path, size) pairs, the `.gguf` a backend loads, or None.

    A split model (`x-00001-of-00003.gguf`) loads from its first shard; else the largest file
    (on a tie the shallower path). A vision projector is chosen only when nothing else is there.
    """
    ggufs = [(rel, size) for rel, size in files if is_gguf(rel)]
    if not ggufs:
        return None
    models = [f for f in ggufs if not _is_projector(f[0])] or ggufs
    first_shards = [f for f in models if _FIRST_SHARD_RE.search(f[0])]
    return max(first_shards or models, key=lambda f: (f[1], -len(f[0])))[0]


def shard_set(rel: str, rels: Iterable[str]) -> list[str]:
    """The files of a split GGUF that `rel` belongs to (just `[rel]` for a single file)."""
    match = _SHARD_RE.search(rel)
    if not match:
        return [rel]
    stem = rel[: match.start()]
    total = match.group(2)
    return sorted(r for r in rels if r.startswith(stem) and (m := _SHARD_RE.search(r)) and m.start() == len(stem)
                  and m.group(2) == total)


def _walk_sizes(root: Path) -> list[tuple[str, int]]:
    out = []
    for rel, path in model_files(root):
        try:
            out.append((rel, path.stat().st_size))
        except OSError:  # gone since the listing, or a dangling symlink
            continue
    return out


def gguf_to_serve(path: Path) -> Path | None:
    """The `.gguf` file a backend loads from a file or folder on this disk (see `pick_gguf`)."""
    path = Path(path)
    if path.is_file():
        return path if is_gguf(path.name) else None
    if not path.is_dir():
        return None
    rel = pick_gguf(_walk_sizes(path))
    return path / rel if rel else None


# ---------------------------------------------------------------- Hugging Face
def hf_root_rel(rels: Iterable[str]) -> str | None:
    """Of relative paths, the folder (relative, "" for the top) that holds the shallowest
    config.json, or None: a Hugging Face model folder, or a snapshot nested inside one."""
    configs = [PurePosixPath(r) for r in rels if PurePosixPath(r).name == HF_CONFIG]
    if not configs:
        return None
    best = min(configs, key=lambda p: (len(p.parts), p.as_posix()))
    parent = best.parent.as_posix()
    return "" if parent == "." else parent


def hf_root(path: Path) -> Path | None:
    """The folder a Hugging Face backend loads from a folder on this disk, or None."""
    path = Path(path)
    if not path.is_dir():
        return None
    if (path / HF_CONFIG).is_file():
        return path
    rel = hf_root_rel(r for r, _ in model_files(path))
    return None if rel is None else path / rel


def is_hf_folder(path: Path) -> bool:
    """A folder with config.json at its top: what serving loads as a Hugging Face model as is."""
    path = Path(path)
    return path.is_dir() and (path / HF_CONFIG).is_file()


def format_of_local(path: Path) -> str | None:
    """`huggingface` for a Hugging Face folder, `gguf` for a `.gguf` file or a folder holding one,
    None for anything else (what serving infers for an absolute path)."""
    path = Path(path)
    if is_hf_folder(path):
        return HUGGINGFACE
    return GGUF if gguf_to_serve(path) is not None else None


def model_to_serve(path: Path, fmt: str) -> Path | None:
    """What a backend of `fmt` loads from `path`: the `.gguf` file, the Hugging Face folder, or
    for a LoRA adapter its `.gguf` file or PEFT folder."""
    if fmt == GGUF:
        return gguf_to_serve(path)
    if fmt == HUGGINGFACE:
        return hf_root(path)
    if fmt == LORA:
        return lora_to_serve(path)
    raise ValueError(f"unknown format {fmt!r}")


# ---------------------------------------------------------------- LoRA adapters
def peft_root_rel(rels: Iterable[str]) -> str | None:
    """Of relative paths, the folder ("" for the top) holding the shallowest adapter_config.json."""
    configs = [PurePosixPath(r) for r in rels if PurePosixPath(r).name == PEFT_CONFIG]
    if not configs:
        return None
    parent = min(configs, key=lambda p: (len(p.parts), p.as_posix())).parent.as_posix()
    return "" if parent == "." else parent


def lora_base_format(rels: Iterable[str]) -> str | None:
    """The format of the base model an adapter holding `rels` goes with: `gguf` for a GGUF adapter
    (llama.cpp), `huggingface` for a PEFT folder (vLLM), None when it is neither."""
    rels = list(rels)
    if any(is_gguf(r) for r in rels):
        return GGUF
    return HUGGINGFACE if peft_root_rel(rels) is not None else None


def lora_to_serve(path: Path) -> Path | None:
    """What an engine loads from an adapter on this disk: the `.gguf` file, or the PEFT folder."""
    path = Path(path)
    found = gguf_to_serve(path)
    if found is not None or not path.is_dir():
        return found
    rel = peft_root_rel(r for r, _ in model_files(path))
    return None if rel is None else path / rel


# ---------------------------------------------------------------- sizes
def weights_rel(files: Iterable[tuple[str, int]], fmt: str) -> list[str]:
    """Of (relative path, size) pairs, the files that hold the weights a backend loads."""
    files = list(files)
    if fmt == LORA:
        chosen = pick_gguf(files)
        if chosen:
            return [chosen]
        root = peft_root_rel(r for r, _ in files)
        inside = [r for r, _ in files if PurePosixPath(r).parent.as_posix() == (root or ".")] if root is not None else []
        return sorted(r for r in inside if r.endswith(WEIGHT_SUFFIXES + FALLBACK_WEIGHT_SUFFIXES))
    if fmt == GGUF:
        chosen = pick_gguf(files)
        return shard_set(chosen, [r for r, _ in files]) if chosen else []
    root = hf_root_rel(r for r, _ in files)
    if root is None:
        return []
    inside = [r for r, _ in files if root == "" or r.startswith(root + "/")]
    top = [r for r in inside if PurePosixPath(r).parent.as_posix() == (root or ".")]
    for suffixes in (WEIGHT_SUFFIXES, FALLBACK_WEIGHT_SUFFIXES):
        found = [r for r in top if r.endswith(suffixes)]
        if found:
            return sorted(found)
    return []


def weights_size(files: Iterable[tuple[str, int]], fmt: str) -> int:
    """Bytes of the weights among (relative path, size) pairs (see `weights_rel`)."""
    files = list(files)
    sizes = dict(files)
    return sum(sizes[r] for r in weights_rel(files, fmt))


def weights_bytes(path: Path, fmt: str) -> int:
    """Bytes of the weights a backend loads from a file or folder on this disk: a GGUF file with
    its sibling shards; a Hugging Face folder's `*.safetensors` (else `*.bin`/`*.pt`)."""
    path = Path(path)
    if path.is_file():
        if fmt != GGUF:
            return 0
        siblings = [(p.name, p.stat().st_size) for p in path.parent.glob("*.gguf") if p.is_file()]
        sizes = dict(siblings)
        return sum(sizes[r] for r in shard_set(path.name, sizes)) if path.name in sizes else path.stat().st_size
    if not path.is_dir():
        return 0
    return weights_size(_walk_sizes(path), fmt)


# ---------------------------------------------------------------- does a source fit its format
def layout_problem(fmt: str, rels: list[str], *, is_dir: bool, name: str) -> str | None:
    """Why a local source (a file named `name`, or a folder holding `rels`) is no `fmt` model, or None."""
    if fmt == GGUF:
        if not is_dir and not is_gguf(name):
            return f"{name} is not a .gguf file."
        if is_dir and not any(is_gguf(r) for r in rels):
            return f"{name} holds no .gguf file."
        return None
    if fmt == HUGGINGFACE:
        if not is_dir or hf_root_rel(rels) is None:
            return f"{name} is not a Hugging Face model folder (no config.json)."
        return None
    if fmt == LORA:
        if not is_dir and not is_gguf(name):
            return f"{name} is not a LoRA adapter: give a GGUF adapter file or a PEFT folder ({PEFT_CONFIG})."
        if is_dir and lora_base_format(rels) is None:
            return f"{name} holds no GGUF adapter and no {PEFT_CONFIG}: it is not a LoRA adapter."
        if is_dir and sum(is_gguf(r) for r in rels) > 1:
            return f"{name} holds more than one .gguf file: a LoRA adapter is one GGUF file."
        return None
    return f"Unknown format {fmt!r}: use gguf, huggingface or lora."


__all__ = [
    "CACHE_MANIFEST_NAME", "FORMATS", "FolderTooLarge", "GGUF", "HF_CONFIG", "HUGGINGFACE", "LORA", "MANIFEST_NAME",
    "MODEL_FORMATS", "PEFT_CONFIG", "SKIPPED_DIRS", "TEMP_SUFFIXES", "format_of_local", "gguf_to_serve", "hf_root",
    "hf_root_rel", "is_hf_folder", "is_model_file", "layout_problem", "lora_base_format", "lora_to_serve",
    "model_files", "model_to_serve", "peft_root_rel", "pick_gguf", "shard_set", "weights_bytes", "weights_rel",
    "weights_size",
]
