"""Engine presets (issue 27 #3): a model's named, stored engine settings, chosen at load.

A preset holds portable settings (the fields below), not flags: each engine gets them as its own
flags (`flags_for`), and those flags then go through the engine's extra_args check at the
version the node has (`BackendAdapter.normalize_extra_args`), so a setting this version of the
engine has no flag for is refused naming the version, as an extra_arg would be. A setting an
engine cannot take at all (a KV cache type it has no kernel for, speculative decoding without a
draft model on llama.cpp) is refused naming the engine; nothing is dropped silently.

The load's own extra_args are applied after the preset's flags, so they win on the same flag.
The instance keeps the preset as it was at load (name and settings): editing a preset changes the
next load, never a running instance behind its back."""
from __future__ import annotations

import json
import re

ENGINES = ("llama-server", "llama-cpp-python", "vllm")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
NO_PRESET = "none"  # a load's `preset: "none"`: the model's default preset is not applied
PARSER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
KV_CACHE_TYPES = ("f16", "bf16", "q8_0", "q4_0", "fp8")
SPECULATIVE_METHODS = ("ngram", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
SPECULATIVE_INTS = {"num_speculative_tokens": (1, 64), "prompt_lookup_max": (1, 64), "prompt_lookup_min": (1, 64)}
TEMPLATE_MAX = 512  # as every extra_arg value (serving.adapters.base.MAX_VALUE_LEN)

# field -> (what it is, for errors and the page)
FIELDS = {
    "context_size": "tokens of context (llama-server --ctx-size, llama-cpp-python --n_ctx, vLLM --max-model-len)",
    "parallel": "requests answered at once (llama-server --parallel, vLLM --max-num-seqs)",
    "kv_cache_type": "the KV cache's type: f16, bf16, q8_0, q4_0 (llama-server --cache-type-k/-v), "
                     "f16 or fp8 (vLLM --kv-cache-dtype)",
    "flash_attention": "flash attention on or off (llama-server --flash-attn, llama-cpp-python --flash_attn)",
    "tool_call_parser": "vLLM --tool-call-parser NAME (with --enable-auto-tool-choice); llama-server: auto "
                        "(--jinja: tool calls read from the model's own template)",
    "reasoning_parser": "vLLM --reasoning-parser NAME; llama-server --reasoning-format none|deepseek|auto",
    "chat_template": "a chat template inline (Jinja) or a built-in template's name (--chat-template; "
                     "llama-cpp-python --chat_format NAME)",
    "speculative": "vLLM --speculative-config: {method: ngram|eagle|eagle3|medusa|mlp_speculator|mtp, "
                   "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min}",
}


class PresetInvalid(ValueError):
    """A preset that cannot be stored, or cannot be applied to the engine chosen (400)."""


def _int(field: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise PresetInvalid(f"{field} needs a whole number")
    try:
        number = int(value)
    except ValueError:
        raise PresetInvalid(f"{field} needs a whole number, got {str(value)[:40]!r}") from None
    if not low <= number <= high:
        raise PresetInvalid(f"{field} must be {low}..{high}, got {number}")
    return number


def _name(field: str, value: object) -> str:
    if not isinstance(value, str) or not PARSER_RE.match(value):
        raise PresetInvalid(f"{field} is a name: letters, digits, . _ - (max 64)")
    return value


def clean_settings(raw: object) -> dict:
    """The settings of a preset, checked (PresetInvalid naming the field); unknown fields refused."""
    if not isinstance(raw, dict):
        raise PresetInvalid("settings is a JSON object of " + ", ".join(FIELDS))
    unknown = sorted(str(k)[:40] for k in raw if k not in FIELDS)
    if unknown:
        raise PresetInvalid(f"unknown setting {', '.join(unknown)} (known: {', '.join(FIELDS)})")
    out: dict = {}
    for field, value in raw.items():
        if value is None or value == "":
            continue  # not set: the engine's own default
        if field == "context_size":
            out[field] = _int(field, value, 64, 4_194_304)
        elif field == "parallel":
            out[field] = _int(field, value, 1, 1024)
        elif field == "kv_cache_type":
            if value not in KV_CACHE_TYPES:
                raise PresetInvalid(f"kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}")
            out[field] = value
        elif field == "flash_attention":
            if not isinstance(value, bool):
                raise PresetInvalid("flash_attention is true or false")
            out[field] = value
        elif field in ("tool_call_parser", "reasoning_parser"):
            out[field] = _name(field, value)
        elif field == "chat_template":
            if not isinstance(value, str) or len(value) > TEMPLATE_MAX or "\0" in value:
                raise PresetInvalid(f"chat_template is text of at most {TEMPLATE_MAX} characters")
            out[field] = value
        elif field == "speculative":
            out[field] = _speculative(value)
    return out


def _speculative(value: object) -> dict:
    if not isinstance(value, dict):
        raise PresetInvalid("speculative is an object: {method, num_speculative_tokens, ...}")
    unknown = sorted(str(k)[:40] for k in value if k not in ("method", *SPECULATIVE_INTS))
    if unknown:
        raise PresetInvalid(f"speculative does not take {', '.join(unknown)} (a draft model is not chosen "
                            "through a preset)")
    if value.get("method") not in SPECULATIVE_METHODS:
        raise PresetInvalid(f"speculative.method must be one of {', '.join(SPECULATIVE_METHODS)}")
    out: dict = {"method": value["method"]}
    for key, (low, high) in SPECULATIVE_INTS.items():
        if value.get(key) is not None:
            out[key] = _int(f"speculative.{key}", value[key], low, high)
    return out


def _is_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def flags_for(engine: str, settings: dict) -> dict[str, object]:
    """The preset's settings as `engine`'s flags ({--flag: value}); PresetInvalid when the engine
    cannot take one of them. The flags are checked against the engine's version by the caller
    (normalize_extra_args), like extra_args."""
    flags: dict[str, object] = {}

    def refuse(field: str, why: str) -> PresetInvalid:
        return PresetInvalid(f"the preset's {field} cannot be applied to {engine}: {why}")

    for field, value in settings.items():
        if engine == "llama-server":
            if field == "context_size":
                flags["--ctx-size"] = value
            elif field == "parallel":
                flags["--parallel"] = value
            elif field == "kv_cache_type":
                if value == "fp8":
                    raise refuse(field, "llama.cpp has no fp8 KV cache (f16, bf16, q8_0, q4_0)")
                flags["--cache-type-k"] = flags["--cache-type-v"] = value
            elif field == "flash_attention":
                flags["--flash-attn"] = value  # on|off on builds that take a value (LlamaServer._check_value)
            elif field == "tool_call_parser":
                if value != "auto":
                    raise refuse(field, "llama-server reads tool calls from the model's chat template (--jinja): "
                                        "use auto")
                flags["--jinja"] = True
            elif field == "reasoning_parser":
                flags["--reasoning-format"] = value
            elif field == "chat_template":
                flags["--chat-template"] = value
                if _is_jinja(value):
                    flags["--jinja"] = True
            elif field == "speculative":
                raise refuse(field, "llama-server speculates with a draft model file (--model-draft), which a "
                                    "preset does not name")
        elif engine == "llama-cpp-python":
            if field == "context_size":
                flags["--n_ctx"] = value
            elif field == "parallel":
                if value != 1:
                    raise refuse(field, "llama-cpp-python's server answers one request at a time")
            elif field == "flash_attention":
                flags["--flash_attn"] = value
            elif field == "chat_template":
                if _is_jinja(value):
                    raise refuse(field, "llama-cpp-python takes a chat format's name (--chat_format), not a "
                                        "template")
                flags["--chat_format"] = value
            else:
                raise refuse(field, "its server has no such setting")
        elif engine == "vllm":
            if field == "context_size":
                flags["--max-model-len"] = value
            elif field == "parallel":
                flags["--max-num-seqs"] = value
            elif field == "kv_cache_type":
                if value in ("q8_0", "q4_0"):
                    raise refuse(field, "vLLM's KV cache is f16/bf16 (auto) or fp8")
                flags["--kv-cache-dtype"] = "fp8" if value == "fp8" else "auto"
            elif field == "flash_attention":
                if not value:
                    raise refuse(field, "vLLM picks its attention backend itself (VLLM_ATTENTION_BACKEND)")
            elif field == "tool_call_parser":
                flags["--enable-auto-tool-choice"] = True
                flags["--tool-call-parser"] = value
            elif field == "reasoning_parser":
                flags["--reasoning-parser"] = value
            elif field == "chat_template":
                flags["--chat-template"] = value
            elif field == "speculative":
                flags["--speculative-config"] = json.dumps(value, separators=(",", ":"), sort_keys=True)
        else:
            raise PresetInvalid(f"no preset mapping for the backend {engine}")
    return flags


def applied(engine: str, version: str, preset: dict | None) -> dict[str, object]:
    """A load's preset ({name, settings}) as `engine`'s checked flags at `version`: PresetInvalid
    naming the preset, the engine and its version when a setting cannot be applied."""
    if not preset or not preset.get("settings"):
        return {}
    from serving.adapters import InvalidExtraArgs, get_adapter

    name = preset.get("name") or "?"
    adapter = get_adapter(engine)
    try:
        flags = flags_for(engine, preset["settings"])
        allowed = adapter.allowed_flags(version)
        for flag, value in flags.items():  # on/off where this version's flag takes a value, not a switch
            if isinstance(value, bool) and allowed.get(flag, "").startswith("choice:on|off"):
                flags[flag] = "on" if value else "off"
        return adapter.normalize_extra_args(flags, version)
    except PresetInvalid as exc:
        raise PresetInvalid(f"preset {name!r}: {exc}") from None
    except InvalidExtraArgs as exc:
        raise PresetInvalid(f"preset {name!r} on {adapter.label} {version or ''}: {exc}".replace(" :", ":")) from None


def normalize_model_path(raw: object) -> str:
    """The key a preset is stored under: a store prefix as the store writes it (one trailing '/'
    dropped), or an absolute path as given; PresetInvalid for anything else."""
    from hub.layout import LORA
    from hub.paths import InvalidPrefix, validate_prefix

    text = raw.strip() if isinstance(raw, str) else ""
    if not text or len(text) > 1024 or any(c in text for c in "\0\n\r\\"):
        raise PresetInvalid("model_path is a store prefix (gguf/..., huggingface/...) or an absolute path")
    if text.startswith("/"):
        if ".." in text.split("/"):
            raise PresetInvalid("model_path may not contain '..'")
        return text
    try:
        prefix = validate_prefix(text)
    except InvalidPrefix as exc:
        raise PresetInvalid(str(exc)) from None
    if prefix.split("/", 1)[0] == LORA:
        raise PresetInvalid(f"{prefix} is a LoRA adapter: presets belong to the base model it loads with")
    return prefix


def format_of(model_path: str) -> str:
    """gguf or huggingface, from the key (a path ending in .gguf is a GGUF file; other paths are
    taken as folders, Hugging Face or GGUF: both formats' engines are checked then)."""
    if model_path.startswith("/"):
        return "gguf" if model_path.lower().endswith(".gguf") else ""
    return model_path.split("/", 1)[0]


def snapshot(preset) -> dict:
    """What a load keeps of an EnginePreset row: its name and settings at the time."""
    return {"name": preset.name, "settings": dict(preset.engine_settings)}


def find(model_path: str, name: str | None):
    """The preset a load names for `model_path` (None: the model's default one, if any; "none":
    no preset); LookupError for a name the model has no preset of."""
    from serving.models import EnginePreset

    if name == NO_PRESET:
        return None
    rows = EnginePreset.objects.filter(model_path=model_path)
    if name:
        row = rows.filter(name=name).first()
        if row is None:
            known = ", ".join(rows.values_list("name", flat=True)[:20]) or "none stored"
            raise LookupError(f"{model_path} has no preset {name[:64]!r} (its presets: {known})")
        return row
    return rows.filter(is_default=True).first()


def engine_checks(fmt: str, settings: dict) -> list[dict]:
    """The preset held against every engine version the nodes report for the model's format:
    [{backend, version, nodes, ok, message}] (what the API and the page show when it is saved)."""
    from hardware.models import Node
    from serving.adapters import get_adapter

    seen: dict[tuple[str, str], list[str]] = {}
    for node in Node.objects.only("name", "backends").order_by("name"):
        for entry in node.backends or []:
            if not isinstance(entry, dict) or not entry.get("available", True):
                continue
            engine = entry.get("name") or entry.get("backend")
            if engine not in ENGINES or (fmt and fmt not in get_adapter(engine).formats):
                continue
            seen.setdefault((engine, str(entry.get("version") or "")), []).append(node.name)
    out = []
    for (engine, version), nodes in sorted(seen.items()):
        try:
            applied(engine, version, {"name": "", "settings": settings})
        except PresetInvalid as exc:
            out.append({"backend": engine, "version": version, "nodes": nodes, "ok": False, "message": str(exc)})
        else:
            out.append({"backend": engine, "version": version, "nodes": nodes, "ok": True, "message": ""})
    return out


def save(*, model_path: object, name: object, settings: object, default: bool, user=None):
    """Create or replace a model's preset: (row, created, engine checks). PresetInvalid when a
    field is wrong, or when no engine version any node reports can take it (a preset no node can
    apply; with no node reporting an engine for the format, it is stored unchecked, which the
    checks list says by being empty)."""
    from django.db import transaction
    from django.utils import timezone

    from serving.models import EnginePreset

    key = normalize_model_path(model_path)
    if not isinstance(name, str) or not NAME_RE.match(name) or name == NO_PRESET:
        raise PresetInvalid(f"a preset's name is a-z 0-9 . _ - (max 64), not {NO_PRESET!r}")
    cleaned = clean_settings(settings)
    if not cleaned:
        raise PresetInvalid("a preset sets at least one of " + ", ".join(FIELDS))
    checks = engine_checks(format_of(key), cleaned)
    if checks and not any(c["ok"] for c in checks):
        raise PresetInvalid("no engine the nodes have can apply it: " + "; ".join(
            f"{c['backend']} {c['version']}: {c['message']}" for c in checks))
    with transaction.atomic():
        if default:
            EnginePreset.objects.filter(model_path=key, is_default=True).exclude(name=name).update(is_default=False)
        row, created = EnginePreset.objects.update_or_create(
            model_path=key, name=name,
            defaults={"engine_settings": cleaned, "is_default": bool(default), "updated_at": timezone.now(),
                      "updated_by": user if getattr(user, "pk", None) else None})
    return row, created, checks


def delete(*, model_path: object, name: object) -> bool:
    """Remove a model's preset (instances loaded with it keep what they were loaded with)."""
    from serving.models import EnginePreset

    key = normalize_model_path(model_path)
    if not isinstance(name, str) or not NAME_RE.match(name):
        return False
    deleted, _ = EnginePreset.objects.filter(model_path=key, name=name).delete()
    return bool(deleted)


def listing(model_path: object | None = None) -> list[dict]:
    """Presets (of one model, or all), each with its engine checks as the nodes stand now."""
    from serving.models import EnginePreset

    rows = EnginePreset.objects.select_related("updated_by")
    if model_path is not None:
        rows = rows.filter(model_path=normalize_model_path(model_path))
    return [out(row) for row in rows[:500]]


def out(row, checks: list[dict] | None = None) -> dict:
    return {"model_path": row.model_path, "name": row.name, "settings": dict(row.engine_settings),
            "default": row.is_default, "updated_at": row.updated_at,
            "updated_by": row.updated_by.username if row.updated_by_id else None,
            "engines": engine_checks(format_of(row.model_path), row.engine_settings) if checks is None else checks}
