"""LoRA adapters loaded with a model (issue 27): the load's `adapters` checked, and a GGUF
adapter's metadata read against its base.

An adapter is `{name, path, scale}`: `name` is served as `<model_name>:<name>`; `path` an
adapter in the store (`lora/<name>`: the node copies it into its cache with the base model, so an
air-gapped node needs only the store) or an absolute path under the allowed model dirs (the rules
of a load's model_path: no '..', a bounded walk, XGEN_IMPORT_DIRS); `scale` the strength a request
for the adapter gets unless it gives its own `lora_scale`. A GGUF adapter must say `general.type = adapter`, `adapter.type = lora`, and
the base model's `general.architecture` (llama.cpp refuses any other at start, with a log line
only; here it is a 400 at load)."""
from __future__ import annotations

import math
import re
from pathlib import Path, PurePosixPath

from hub import layout
from hub.imports import HubInputError, LoadSource, check_load_path
from hub.paths import InvalidPrefix, validate_prefix


class LoadRefused(ValueError):
    """An adapter the load refuses: 400 with `code` (serving.control.planning answers it as its
    own LoadRefused; this module does not import planning, which imports it)."""

    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def check_load_path_or_refuse(raw: str) -> LoadSource:
    try:
        return check_load_path(raw)
    except HubInputError as exc:
        raise LoadRefused(400, str(exc), code="invalid_path") from None

ADAPTER_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
MAX_ADAPTERS = 16
MAX_SCALE = 16.0


def gguf_metadata(path: Path | str, keys: tuple[str, ...]) -> dict[str, str]:
    """The string values of `keys` in a GGUF file's header (missing keys left out); ValueError
    when the file is not a GGUF."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # noqa: BLE001 - the gguf package raises bare ValueError / struct errors
        raise ValueError(f"not a readable GGUF file: {exc}") from None
    found: dict[str, str] = {}
    for key in keys:
        field = reader.get_field(key)
        if field is not None:
            try:
                found[key] = str(field.contents())
            except Exception:  # noqa: BLE001 - a field of another type: not a string
                continue
    return found


PEFT_CONFIG = "adapter_config.json"
PEFT_CONFIG_MAX = 1 << 20


def check_peft_folder(path: str, name: str) -> None:
    """LoadRefused 400 unless `path` is a folder the load rules allow (XGEN_IMPORT_DIRS, a bounded
    walk) holding a PEFT LoRA adapter: adapter_config.json with peft_type LORA at its top."""
    import json

    from hub.imports import LOAD_SCAN_MAX_ENTRIES, check_import_path

    try:
        source = check_import_path(path, action="load", max_entries=LOAD_SCAN_MAX_ENTRIES)
    except HubInputError as exc:
        raise LoadRefused(400, str(exc), code="invalid_path") from None
    config = next((f for f in source.files if f.rel == PEFT_CONFIG), None) if source.is_dir else None
    if config is None:
        raise LoadRefused(400, f"adapter {name!r}: a Hugging Face model takes a PEFT folder ({PEFT_CONFIG} at its "
                               "top)", code="invalid_adapter")
    try:
        if config.size > PEFT_CONFIG_MAX:
            raise ValueError("too large")
        data = json.loads(Path(config.real).read_text())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise LoadRefused(400, f"adapter {name!r}: {PEFT_CONFIG} is not readable JSON ({exc})",
                          code="invalid_adapter") from None
    if not isinstance(data, dict) or str(data.get("peft_type", "")).upper() != "LORA":
        raise LoadRefused(400, f"adapter {name!r}: {PEFT_CONFIG} says peft_type "
                               f"{str(data.get('peft_type') if isinstance(data, dict) else None)[:40]!r}, not LORA",
                          code="invalid_adapter")


def check_gguf_adapter(path: Path | str, *, base: Path | str | None) -> None:
    """LoadRefused 400 `invalid_adapter` unless `path` is a LoRA adapter GGUF of the base's
    architecture (`base`: the base's GGUF where this node can read it)."""
    try:
        meta = gguf_metadata(path, ("general.type", "adapter.type", "general.architecture"))
    except ValueError as exc:
        raise LoadRefused(400, f"adapter {str(path)[:200]!r}: {exc}", code="invalid_adapter") from None
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise LoadRefused(400, f"adapter {str(path)[:200]!r} is not a LoRA adapter GGUF (general.type "
                               f"{meta.get('general.type')!r}, adapter.type {meta.get('adapter.type')!r})",
                          code="invalid_adapter")
    if base is not None:
        try:
            arch = gguf_metadata(base, ("general.architecture",)).get("general.architecture")
        except ValueError:
            arch = None
        if arch and meta.get("general.architecture") != arch:
            raise LoadRefused(400, f"adapter {str(path)[:200]!r} is for {meta.get('general.architecture')!r}; "
                                   f"the base model is {arch!r}", code="invalid_adapter")


def check_adapters(raw, *, fmt: str, base_local: Path | None, on_this_node: bool) -> list[dict]:
    """The load's adapters as stored on the instance ([{name, path, scale}]); LoadRefused 400."""
    if not raw:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_ADAPTERS:
        raise LoadRefused(400, f"adapters must be a list of at most {MAX_ADAPTERS}")
    out: list[dict] = []
    seen: set[str] = set()
    for item in raw:
        item = item if isinstance(item, dict) else getattr(item, "dict", lambda: None)()
        if not isinstance(item, dict):
            raise LoadRefused(400, "each adapter is {name, path, scale?}")
        name, path, scale = item.get("name"), item.get("path"), item.get("scale", 1.0)
        if not isinstance(name, str) or not ADAPTER_NAME_RE.match(name):
            raise LoadRefused(400, f"adapter name {str(name)[:80]!r} may use a-z 0-9 . _ - (max 64)")
        if name in seen:
            raise LoadRefused(400, f"adapter name {name!r} is given twice")
        seen.add(name)
        if scale is None:
            scale = 1.0
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale) \
                or abs(scale) > MAX_SCALE:
            raise LoadRefused(400, f"adapter {name!r}: scale must be a number in -{MAX_SCALE:g}..{MAX_SCALE:g}")
        if not isinstance(path, str) or not path.strip() or len(path) > 1024 or any(c in path for c in "\0\n\r"):
            raise LoadRefused(400, f"adapter {name!r}: path is empty, too long, or has a newline/NUL",
                              code="invalid_path")
        path = path.strip()
        if not path.startswith("/"):
            out.append({"name": name, "path": stored_adapter(name, path, fmt=fmt), "scale": float(scale)})
            continue
        if ".." in PurePosixPath(path).parts:
            raise LoadRefused(400, f"adapter {name!r}: path contains '..'; give the real absolute path",
                              code="invalid_path")
        if fmt == "gguf" and ("," in path or ":" in path):  # llama-server's --lora-scaled list syntax
            raise LoadRefused(400, f"adapter {name!r}: a GGUF adapter's path may not hold ',' or ':'",
                              code="invalid_path")
        if on_this_node and fmt == "gguf":
            local = check_load_path_or_refuse(path)
            if local.format != "gguf":
                raise LoadRefused(400, f"adapter {name!r}: a GGUF model takes a GGUF adapter", code="invalid_adapter")
            check_gguf_adapter(local.serve, base=base_local)
        elif on_this_node:
            check_peft_folder(path, name)
        out.append({"name": name, "path": path, "scale": float(scale)})
    return out


def stored_adapter(name: str, path: str, *, fmt: str) -> str:
    """The store prefix of an adapter given as `lora/<name>`, checked against the index (or the
    store's manifest when it is not indexed yet): complete, and made for a base of `fmt` (a GGUF
    adapter for a GGUF model, a PEFT folder for a Hugging Face one). Its architecture is checked
    against the base on the node, once both are in its cache (serving.node.supervisor)."""
    try:
        prefix = validate_prefix(path)
    except InvalidPrefix as exc:
        raise LoadRefused(400, f"adapter {name!r}: {exc} (an adapter is lora/<name> in the store, or an absolute "
                               "path)", code="invalid_path") from None
    if prefix.split("/", 1)[0] != layout.LORA or prefix.count("/") != 1:
        raise LoadRefused(400, f"adapter {name!r}: {prefix!r} is not an adapter in the store (lora/<name>)",
                          code="invalid_path")
    from hub.models import ModelArtifact

    artifact = ModelArtifact.objects.filter(prefix=prefix).first()
    if artifact is not None:
        if not artifact.complete:
            raise LoadRefused(409, f"adapter {name!r}: {prefix} is still being written to the store; try again when "
                                   "it is complete", code="model_incomplete")
        rels = [str(f.get("path", "")) for f in artifact.files or [] if isinstance(f, dict)]
    else:
        try:
            from hub.store import get_store

            manifest = get_store().read_manifest(prefix)
        except Exception as exc:  # an unreachable store is a clear refusal, not a 500
            raise LoadRefused(503, f"the model store cannot be read: {exc.__class__.__name__}: {exc}",
                              code="store_unavailable") from None
        if manifest is None:
            raise LoadRefused(400, f"adapter {name!r}: no adapter {prefix!r} in the store (see /api/storage/models)",
                              code="adapter_not_found")
        rels = [f.path for f in manifest.files]
    kind = layout.lora_base_format(rels)
    if kind is None:
        raise LoadRefused(400, f"adapter {name!r}: {prefix} holds no GGUF adapter and no {layout.PEFT_CONFIG}",
                          code="invalid_adapter")
    if kind != fmt:
        what = "a GGUF adapter (for a GGUF model on llama.cpp)" if kind == layout.GGUF else \
            "a PEFT adapter (for a Hugging Face model on vLLM)"
        raise LoadRefused(400, f"adapter {name!r}: {prefix} is {what}; this model is {fmt}", code="invalid_adapter")
    return prefix


def is_stored(adapter: dict) -> bool:
    """An adapter the node copies from the store (a `lora/<name>` prefix, not an absolute path)."""
    return not str(adapter.get("path", "")).startswith("/")
