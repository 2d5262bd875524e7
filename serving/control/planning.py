"""The load decision, made once: what a model is (its source), which node runs it, and the
LaunchPlan: format, backend (flavour, version, binary), GPU type and GPUs, the command line as a
template, the environment it adds, the host it listens on, the memory estimate and why.

The web side makes the plan when a load is requested (the Load page's verdict and command line
come from the same function) and stores it on the instance; the node agent launches from it,
filling in only the port and the model's local path (a store prefix is synced into the node
cache on the node, so that path is known only there), and the Python interpreter of a backend
that runs as a module (the node's, which a web process on another host does not know). An
instance from before plans existed
gets its plan made once, on the node, from its row (`plan_for_instance`).
"""
from __future__ import annotations

import dataclasses
import math
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path, PurePosixPath

from django.conf import settings

from hardware.models import GpuDevice, Node
from hardware.services import wait_for_inventory
from hub import layout
from hub.ggufmeta import has_kv_shape
from hub.imports import HubInputError, LoadSource, check_load_path
from hub.models import ModelArtifact
from hub.paths import InvalidPrefix, validate_prefix
from serving.adapters import InvalidExtraArgs, LaunchSpec, get_adapter
from serving.adapters.base import CTX_FLAGS, share_text
from serving.control import presets
from serving.control.lora import check_adapters, is_stored
from serving.control.placement import (
    MemoryEstimate,
    NodeOption,
    PlacementError,
    assign_gpus,
    bind_host,
    choose_node,
    estimate_memory,
    gguf_header,
    gib,
    gpu_rooms,
    hf_header,
    ram_room,
)
from serving.control.selection import (
    CPU,
    BackendUnavailable,
    backend_options,
    choose_backend,
    fallback_backends,
    node_gpu_type,
)
from serving.models import ACTIVE_STATES, DesiredState, InstanceType, ModelInstance

MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
# argv items the agent fills in at launch: the port it picks, the model's local path, its Python,
# and the file holding the backend's secret (made at each launch; never in the plan or the argv).
PORT_SLOT = "{port}"
MODEL_SLOT = "{model}"
PYTHON_SLOT = "{python}"
KEY_FILE_SLOT = "{api_key_file}"
SLOTS = (PORT_SLOT, MODEL_SLOT, PYTHON_SLOT, KEY_FILE_SLOT)


def adapter_slot(name: str) -> str:
    """Where an adapter from the store goes in the argv (inside an item: llama-server's
    `--lora-scaled PATH:SCALE,...`, vLLM's `<model>:<name>=PATH`): the agent fills in the file it
    copied into its cache."""
    return "{adapter:" + name + "}"


class LoadRefused(Exception):
    """A request that cannot be done; `status` is the HTTP status the API answers with."""

    def __init__(self, status: int, message: str, code: str = "invalid_request", *,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after  # seconds, sent as Retry-After (a node still starting)


# ---------------------------------------------------------------- model source
@dataclass(frozen=True)
class ModelSource:
    model_path: str  # as given (normalized)
    kind: str  # "prefix" | "path"
    fmt: str  # gguf | huggingface
    local_path: Path | None  # a file or dir readable here (for the estimate), if any
    artifact: ModelArtifact | None
    size_bytes: int
    header: dict = field(default_factory=dict)  # what sizes it (hub.index.stored_model_header), if known


def _validate_prefix(prefix: str) -> str:
    try:
        return validate_prefix(prefix)
    except InvalidPrefix as exc:
        raise LoadRefused(400, f"'{prefix[:120]}' is not a valid store prefix: {exc}") from None


def resolve_source(model_path: str, *, on_this_node: bool) -> ModelSource:
    """What `model_path` names: a store prefix (must be in the store) or an absolute path on the node."""
    raw = (model_path or "").strip()
    if not raw or len(raw) > 1024 or any(c in raw for c in "\0\n\r"):
        raise LoadRefused(400, "model_path is empty, too long, or has a newline/NUL")
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:
        raise LoadRefused(400, "model_path is not valid UTF-8") from None
    if raw.startswith("/"):
        parts = PurePosixPath(raw).parts
        if ".." in parts:
            raise LoadRefused(400, f"model_path {raw[:200]!r} contains '..'; give the real absolute path")
        if on_this_node:
            local = check_load_path_or_refuse(raw)
            return ModelSource(raw, "path", local.format, local.serve, None, local.size_bytes)
        fmt = "gguf" if layout.is_gguf(raw) else "huggingface"
        return ModelSource(raw, "path", fmt, None, None, 0)
    if raw.startswith("~") or "\\" in raw:
        raise LoadRefused(400, "model_path must be a store prefix (gguf/..., huggingface/...) or an absolute path")
    prefix = _validate_prefix(raw)
    if prefix.split("/", 1)[0] == layout.LORA:
        raise LoadRefused(400, f"{prefix} is a LoRA adapter: load its base model with it (adapters: "
                               f'[{{"name": ..., "path": "{prefix}"}}])', code="invalid_path")
    artifact = ModelArtifact.objects.filter(prefix=prefix).first()
    if artifact is not None:
        if not artifact.complete:
            raise LoadRefused(409, f"{prefix} is still being written to the store; try again when it is complete")
        header = stored_model_header(prefix, artifact.format, artifact.files, artifact.model_header)
        if header and header != artifact.model_header:
            ModelArtifact.objects.filter(pk=artifact.pk).update(model_header=header)
        return ModelSource(prefix, "prefix", artifact.format, None, artifact, artifact.size_bytes, header)
    manifest = _store_manifest(prefix)  # not indexed yet: the store is the source of truth
    if manifest is None:
        raise LoadRefused(400, f"no model {prefix!r} in the store (see /api/storage/models)", code="model_not_found")
    fmt = prefix.split("/", 1)[0]
    files = [{"path": f.path, "size": f.size, "etag": f.etag} for f in manifest.files]
    header = stored_model_header(prefix, fmt, files, None)
    return ModelSource(prefix, "prefix", fmt, None, None, manifest.size_bytes, header)


def stored_model_header(prefix: str, fmt: str, files: list[dict], cached: dict | None) -> dict:
    """What sizes a store model (hub.index.stored_model_header): from the index row when it has it
    for the same file, else read from the store now (a model not indexed yet, or indexed before
    the index kept it)."""
    from hub.index import stored_model_header as read
    from hub.store import get_store

    try:
        return read(get_store(), prefix, fmt, files, cached)  # the cached header when it is the same file's: no I/O
    except Exception:  # noqa: BLE001 - a store that cannot be set up leaves the size-based estimate
        return {}


def check_load_path_or_refuse(raw: str) -> LoadSource:
    """A local path a load may serve (hub.imports.check_load_path: the rules of uploads, under
    XGEN_IMPORT_DIRS, a bounded walk); 400 `invalid_path` naming the reason. The web request and
    the node agent, before it spawns, both run it."""
    try:
        return check_load_path(raw)
    except HubInputError as exc:
        raise LoadRefused(400, str(exc), code="invalid_path") from None


def _store_manifest(prefix: str):
    try:
        from hub.store import get_store

        return get_store().read_manifest(prefix)
    except Exception as exc:  # an unreachable store is a clear refusal, not a 500
        raise LoadRefused(503, f"the model store cannot be read: {exc.__class__.__name__}: {exc}",
                          code="store_unavailable") from None


def default_model_name(source: ModelSource) -> str:
    base = PurePosixPath(source.model_path).name
    if layout.is_gguf(base):
        base = base[: -len(layout.GGUF_SUFFIX)]
    name = re.sub(r"[^A-Za-z0-9._:/-]", "-", base).strip("-.") or "model"
    return name[:128]


# ---------------------------------------------------------------- the plan
@dataclass(frozen=True)
class LaunchPlan:
    """How an instance's backend is started; stored on the instance as JSON (`to_json`)."""

    model_name: str
    server_type: str
    model_path: str  # the store prefix or absolute path it serves
    format: str  # gguf | huggingface
    backend: str
    flavour: str
    version: str
    executable: str
    gpu_type: str  # the node's GPU type (NVIDIA, AMD_CDNA, AMD_RDNA), "" on a node without GPUs
    gpus: tuple[int, ...]
    tensor_parallel_size: int
    argv: tuple[str, ...]  # with PORT_SLOT, MODEL_SLOT (PYTHON_SLOT, KEY_FILE_SLOT) where the agent fills them in
    env: dict[str, str] = field(default_factory=dict)  # added to the allowlisted environment
    host: str = "127.0.0.1"
    estimate_mib: int = 0
    estimate_detail: str = ""
    reason: str = ""  # why this backend
    fit: str = ""  # where it fits (the verdict line)
    fallback: bool = False  # may another backend be tried when this one fails to come up
    fell_back_from: str = ""  # the backend that failed first (a plan falls back once)
    adapters: tuple[dict, ...] = ()  # LoRA adapters ({name, path, scale}) in the argv (issue 27)
    preset: dict | None = None  # the engine preset applied ({name, settings}, issue 27 #3) and its flags
    context: int = 0  # the context it runs with (the load's, or the one the console chose); 0: the engine's default

    @property
    def is_embedding(self) -> bool:
        return self.server_type == InstanceType.EMBEDDING

    @property
    def is_rerank(self) -> bool:
        return self.server_type == InstanceType.RERANK

    @property
    def known_model_file(self) -> str | None:
        """The model path the backend gets, where it is known before the agent resolves it: an
        absolute .gguf file or Hugging Face folder (a store prefix lands in the node's cache)."""
        if self.model_path.startswith("/") and (layout.is_gguf(self.model_path) or self.format == "huggingface"):
            return self.model_path
        return None

    def command(self, *, port: int | None = None, model: str | Path | None = None,
                python: str | None = None, key_file: str | Path | None = None,
                adapters: dict[str, str] | None = None) -> list[str]:
        """The argv, with the port, the model path, the interpreter, the secret's file and the
        local files of adapters from the store (name -> path) filled in where they are known."""
        fill = {PORT_SLOT: None if port is None else str(port), MODEL_SLOT: None if model is None else str(model),
                PYTHON_SLOT: python, KEY_FILE_SLOT: None if key_file is None else str(key_file)}
        argv = [fill.get(item) or item for item in self.argv]
        for name, path in (adapters or {}).items():
            slot = adapter_slot(name)
            argv = [item.replace(slot, path) for item in argv]
        return argv

    def command_line(self, *, port: int | None = None, model: str | Path | None = None,
                     python: str | None = None) -> str:
        """The command as a shell line to copy (placeholders left bare)."""
        argv = self.command(port=port, model=model, python=python)
        return " ".join(a if a in SLOTS else shlex.quote(a) for a in argv)

    def to_json(self) -> dict:
        data = asdict(self)
        data["gpus"], data["argv"] = list(self.gpus), list(self.argv)
        data["adapters"] = [dict(a) for a in self.adapters]
        return data

    @classmethod
    def from_json(cls, data: dict) -> LaunchPlan:
        """The plan stored on an instance; ValueError when it is not one."""
        if not isinstance(data, dict):
            raise ValueError("a launch plan is a JSON object")
        known = {f.name for f in fields(cls)}
        try:
            values = {k: v for k, v in data.items() if k in known}
            values["gpus"] = tuple(int(g) for g in values.get("gpus") or ())
            values["argv"] = tuple(str(a) for a in values["argv"])
            values["env"] = {str(k): str(v) for k, v in (values.get("env") or {}).items()}
            values["adapters"] = tuple(dict(a) for a in values.get("adapters") or () if isinstance(a, dict))
            return cls(**values)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a launch plan: {exc}") from None


@dataclass(frozen=True)
class LoadPlan:
    """A planned load: the LaunchPlan and what the request and the Load page show beside it."""

    source: ModelSource
    node: Node
    launch: LaunchPlan
    estimate: MemoryEstimate
    extra_args: dict  # normalized
    placement: str = ""

    @property
    def model_name(self) -> str:
        return self.launch.model_name

    @property
    def gpus(self) -> list[int]:
        return list(self.launch.gpus)

    @property
    def fit(self) -> str:
        return self.launch.fit

    @property
    def preview_model(self) -> str:
        return str(self.source.local_path or self.source.model_path)

    @property
    def command(self) -> list[str]:
        """The command line as it will run (the port is chosen at start)."""
        return self.launch.command(model=self.preview_model, python=local_python(self.node.name))

    @property
    def command_line(self) -> str:
        return self.launch.command_line(model=self.preview_model, python=local_python(self.node.name))


def local_python(node_name: str) -> str | None:
    """The interpreter a Python-module backend runs in on `node_name`, when that node's agent is
    this process's (all-in-one); None when only that node knows it."""
    return sys.executable if node_name == settings.NODE_NAME else None


def make_launch_plan(*, node: Node, source: ModelSource, model_name: str, server_type: str, backend: str | None,
                     gpus: list[int] | None, tensor_parallel_size: int | None, extra_args: dict | None,
                     placed_gpus: list[int] | None = None, node_type: str | None = None,
                     avoid_gpus: frozenset[int] = frozenset(),
                     adapters: list[dict] | None = None,
                     preset: dict | None = None, instance_id: int | None = None) -> tuple[LaunchPlan, MemoryEstimate, dict]:
    """The one place a load is decided: (plan, estimate, normalized extra_args); raises LoadRefused.

    The backend is chosen here and nowhere else on the load path (`choose_backend`: the one entry,
    for a new load, a plan made again, a 0.1.0 row's plan and a fallback alike).

    `placed_gpus`: GPUs already held by the instance (a plan made later for an existing row, a
    fallback) are taken as they are, without a new fit check, by a backend that uses the GPU (a
    CPU build keeps none). `node_type`: the node's GPU type when the caller has it (a plan made
    again), else read here. `avoid_gpus`: GPUs of the node that another replica of the model holds
    (a replica never shares one). `preset`: the engine preset ({name, settings}) whose flags, as
    the chosen engine takes them, come before extra_args (serving.control.presets); the normalized
    extra_args returned are the load's own, without the preset's. `instance_id`: the instance a
    plan is made again for (not counted among the backends that share the node's CPU)."""
    node_type = node_type or _gpu_type_of(node)
    try:
        choice = choose_backend(fmt=source.fmt, gpu_type=node_type, backends=node.backends,
                                requested=backend, node_name=node.name, server_type=server_type)
    except BackendUnavailable as exc:
        raise LoadRefused(400, str(exc), code="backend_unavailable") from None
    adapter = get_adapter(choice.backend)
    if adapters and not adapter.supports_adapters:
        raise LoadRefused(400, f"{choice.backend} does not load LoRA adapters; choose llama-server (GGUF) or vLLM",
                          code="adapters_unsupported")
    try:
        extra = adapter.normalize_extra_args(extra_args, choice.version)
    except InvalidExtraArgs as exc:
        raise LoadRefused(400, str(exc), code="invalid_extra_args") from None
    try:
        preset_flags = presets.applied(choice.backend, choice.version, preset)
    except presets.PresetInvalid as exc:
        raise LoadRefused(400, str(exc), code="invalid_preset") from None
    run_args = {**preset_flags, **extra}  # the load's own extra_args win over its preset's
    tp = tensor_parallel_size or 1
    if tp < 1 or tp > 64:
        raise LoadRefused(400, "tensor_parallel_size must be 1..64")
    ctx = next((run_args[f] for f in CTX_FLAGS if run_args.get(f)), None)
    header = source.header or model_header(source)
    # The contexts to try, largest first: the load's own, else (an engine whose default the
    # console replaces) the model's trained context and the powers of two below it down to 4,096.
    contexts: list[int | None] = [int(ctx)] if ctx else (context_choices(header) if adapter.context_flag else [])
    contexts = contexts or [None]

    def estimate_at(n_ctx: int | None) -> MemoryEstimate:
        est = estimate_memory(source.local_path, fmt=source.fmt, size_bytes=source.size_bytes, ctx=n_ctx,
                              header=header)
        return with_measurement(est, model_path=source.model_path, backend=f"{choice.backend} ({choice.flavour})",
                                ctx=n_ctx or 0, tensor_parallel_size=tensor_parallel_size or 1)

    too_big = ""  # why the model's whole context was not taken (the verdict says it)
    if placed_gpus is not None or not choice.uses_gpu:
        if not choice.uses_gpu and gpus:
            raise LoadRefused(400, f"{choice.backend} ({choice.flavour}) runs on the CPU; do not pick GPUs")
        chosen = list(placed_gpus or []) if choice.uses_gpu else []
        room = _room_mib(node, chosen, instance_id) if len(contexts) > 1 else None  # one context: nothing to choose
        for n_ctx in contexts:
            estimate = estimate_at(n_ctx)
            if room is None or estimate.total_mib <= room:
                break
            too_big = too_big or (f"needs ~{gib(estimate.total_mib)}, more than the "
                                  f"{gib(room)} free {'on its GPUs' if chosen else 'in RAM'} of {node.name}")
        if placed_gpus is not None:
            where = f"GPU {', '.join(map(str, chosen))} of {node.name}" if chosen else f"the CPU of {node.name}"
            fit = f"runs on {where} (as recorded): needs ~{gib(estimate.total_mib)}"
        else:
            fit = f"runs on the CPU of {node.name}: needs ~{gib(estimate.total_mib)} of RAM"
    else:
        # Unpinned on_demand models in the way count as room: the start evicts them (serving.control.capacity).
        rooms = [r for r in gpu_rooms(node, evictable_free=True) if r.index not in avoid_gpus]
        if avoid_gpus and not rooms:
            raise LoadRefused(409, f"every GPU of {node.name} holds a replica of {model_name} already",
                              code="does_not_fit")
        for n_ctx in contexts:
            estimate = estimate_at(n_ctx)
            try:
                chosen, fit = assign_gpus(node_name=node.name, gpus=rooms, need_mib=estimate.total_mib,
                                          requested=gpus or None, tensor_parallel_size=tp)
                break
            except PlacementError as exc:
                if n_ctx == contexts[-1]:
                    least = f" (with a context of {n_ctx:,} tokens, the least the console sets)" \
                        if len(contexts) > 1 else ""
                    raise LoadRefused(409, f"{exc}{least}", code="does_not_fit") from None
                too_big = too_big or str(exc)
    chosen_ctx = n_ctx if not ctx else None
    context_reason = _context_reason(chosen_ctx, header, too_big) if chosen_ctx else ""
    share = 0.0
    if chosen and choice.uses_gpu and adapter.gpu_share_flag:
        share, estimate = gpu_share(node, chosen, estimate, given=run_args.get(adapter.gpu_share_flag),
                                    instance_id=instance_id, placed=placed_gpus is not None)
        if share:
            fit += f"; {choice.backend} takes {share_text(share)} of each: ~{gib(estimate.total_mib)}"
    # The node's GPU type also on a CPU placement: the backend is then told to see no GPU.
    gpu_type = "" if node_type == CPU else node_type
    spec = LaunchSpec(
        model_file=Path(MODEL_SLOT), model_name=model_name, server_type=server_type, host=bind_host(node.address),
        port=PORT_SLOT, gpus=tuple(chosen), gpu_type=gpu_type, flavour=choice.flavour, version=choice.version,
        executable=choice.path, python=PYTHON_SLOT, tensor_parallel_size=tp, extra_args=run_args,
        extra_args_checked=True, api_key_file=KEY_FILE_SLOT, cpu_cores=node.cpu_count or 0,
        cpu_backends=1 + (0 if chosen else cpu_backends_on(node, besides=instance_id)),
        context=chosen_ctx or 0, context_reason=context_reason, gpu_share=share,
        context_trained=int(header.get("ctx") or 0),
        adapters=tuple((a["name"], adapter_slot(a["name"]) if is_stored(a) else a["path"], float(a.get("scale", 1.0)))
                       for a in adapters or ()),
    )
    plan = LaunchPlan(
        model_name=model_name, server_type=server_type, model_path=source.model_path, format=source.fmt,
        backend=choice.backend, flavour=choice.flavour, version=choice.version, executable=choice.path,
        gpu_type=gpu_type, gpus=tuple(chosen), tensor_parallel_size=tp, argv=tuple(adapter.build_command(spec)),
        env=adapter.env_additions(spec), host=spec.host, estimate_mib=estimate.total_mib,
        estimate_detail=estimate.detail, fit=fit, adapters=tuple(adapters or ()), context=n_ctx or 0,
        reason="; ".join(filter(None, (choice.reason, adapter.serving_defaults(spec)[1]))),
        preset={**preset, "flags": preset_flags} if preset else None,
    )
    return plan, estimate, extra


def model_header(source: ModelSource) -> dict:
    """The architecture keys (placement.gguf_header's) of a model on this disk: a GGUF's header, or
    a Hugging Face folder's config.json ({} for anything else)."""
    path = source.local_path
    if path is None:
        return {}
    if source.fmt == layout.GGUF and path.is_file():
        head = gguf_header(path)
    elif source.fmt == layout.HUGGINGFACE and (path / layout.HF_CONFIG).is_file():
        head = hf_header(path / layout.HF_CONFIG)
    else:
        return {}
    return head if has_kv_shape(head) else {}


MIN_CHOSEN_CTX = 4096  # llama.cpp's own floor when it shrinks a context to fit (--fit-ctx)


def context_choices(header: dict) -> list[int]:
    """The contexts the console tries, largest first: the model's trained context (a GGUF's, or a
    config.json's max_position_embeddings), then the powers of two below it down to MIN_CHOSEN_CTX
    ([] when the header does not say)."""
    if not has_kv_shape(header):
        return []
    trained = int(header["ctx"])
    out = [trained]
    step = 1 << (trained - 1).bit_length() - 1 if trained > 1 else 0  # the largest power of two below it
    while step >= MIN_CHOSEN_CTX:
        if step < trained:
            out.append(step)
        step //= 2
    return out


def _room_mib(node: Node, gpus: list[int], instance_id: int | None) -> int | None:
    """Memory a model may take where it runs (None: unknown): free on `gpus`, else in the node's RAM."""
    if gpus:
        rooms = [r.free_mib for r in gpu_rooms(node, exclude_instance=instance_id, evictable_free=True)
                 if r.index in gpus]
        return sum(rooms) if rooms else None
    return ram_room(node, exclude_instance=instance_id)


GPU_SHARE_DEFAULT = 0.9  # vLLM's own --gpu-memory-utilization


def _share_between(need: float, most: float) -> float:
    """The largest share up to `most` in hundredths (else thousandths) that still holds `need`; the
    least one above `need` when none does (the fit check placed the model, so it is rounding)."""
    for step in (100, 1000):
        share = math.floor(most * step) / step
        if share >= need:
            return min(1.0, share)
    return min(1.0, math.ceil(need * 1000) / 1000)


def gpu_share(node: Node, gpus: list[int], estimate: MemoryEstimate, *, given: object, instance_id: int | None,
              placed: bool) -> tuple[float, MemoryEstimate]:
    """The fraction of each GPU's memory an engine that takes a fixed share of it at start (vLLM's
    `--gpu-memory-utilization`: weights, then the KV cache fills the rest; it refuses to start
    while less than that share of the GPU is free) gets, and the estimate made that share, since
    that is what it holds. The load's own share stands (409 where a GPU has not that much free);
    else vLLM's default 0.9, or what the GPUs have free when less (a GPU that other models
    share), and never less than the model's estimate. (0.0, estimate) when the GPUs' sizes are
    not known."""
    rooms = {r.index: r for r in gpu_rooms(node, exclude_instance=instance_id, evictable_free=True)}
    held = [rooms[i] for i in gpus if i in rooms and rooms[i].total_mib > 0]
    if len(held) != len(gpus):
        return 0.0, estimate
    need = max(estimate.total_mib / len(held) / r.total_mib for r in held)
    if given:
        share = float(given)  # type: ignore[arg-type]  # normalize_extra_args made it a number
        short = [r for r in held if r.free_mib < share * r.total_mib]
        if short and not placed:
            r = short[0]
            raise LoadRefused(409, f"vLLM takes {share:.2f} of each GPU's memory at start (--gpu-memory-utilization "
                                   f"{share:g}): {gib(share * r.total_mib)} of GPU {r.index} of {node.name}, which has "
                                   f"{gib(r.free_mib)} free", code="does_not_fit")
        why = f"{share:.2f} of each GPU's memory at start, as the load sets"
    else:
        free = min(r.free_mib / r.total_mib for r in held)
        share = _share_between(need, min(GPU_SHARE_DEFAULT, free))
        why = (f"{share_text(share)} of each GPU's memory at start (--gpu-memory-utilization"
               + (f"; vLLM's own {GPU_SHARE_DEFAULT} would not start: {free:.2f} is free)" if free < GPU_SHARE_DEFAULT
                  else ")"))
    total = round(sum(share * r.total_mib for r in held))
    detail = (f"vLLM takes {why}: {gib(total)}; the model needs ~{gib(estimate.total_mib)} of it ({estimate.detail}) "
              "and its KV cache gets the rest")
    return share, dataclasses.replace(estimate, total_mib=total, detail=detail)


def _context_reason(n_ctx: int, header: dict, too_big: str) -> str:
    trained = int(header.get("ctx") or 0)
    if n_ctx == trained or not too_big:
        return f"context {n_ctx:,} tokens, the model's own"
    return f"context {n_ctx:,} tokens of the model's {trained:,}: with all of them it {too_big}"


def _gpu_type_of(node: Node) -> str:
    """The node's GPU type (CPU on a node without GPUs), from its GPU rows."""
    return node_gpu_type(list(GpuDevice.objects.filter(node=node).values_list("type", flat=True)))


def _plan_gpu_type(plan: LoadPlan) -> str:
    """The node's GPU type as its plan recorded it (a CPU node's plan records "")."""
    return plan.launch.gpu_type or CPU


def pick_node(name: str | None) -> Node:
    if name:
        node = Node.objects.filter(name=name).first()
        if node is None:
            raise LoadRefused(400, f"unknown node {name!r}", code="node_not_found")
        if not node.is_online:
            raise LoadRefused(409, f"node {name} is {node.status}: its agent has not heartbeated "
                                   f"for {int(node.heartbeat_age_s or 0)} s", code="node_offline")
        if node.draining_since is not None:
            raise LoadRefused(409, f"node {name} is draining: its agent is stopping (since "
                                   f"{node.draining_since:%Y-%m-%d %H:%M:%S} UTC); no new model is placed on it",
                              code="node_draining")
        return node
    fresh = list(Node.placeable())
    if not fresh:
        raise LoadRefused(409, "no node agent is online to run the model", code="node_offline")
    local = [n for n in fresh if n.name == settings.NODE_NAME]
    return (local or fresh)[0]


def plan_load(*, model_path: str, model_name: str | None = None, server_type: str = "llm",
              backend: str | None = None, node: str | None = None, gpus: list[int] | None = None,
              tensor_parallel_size: int | None = None, extra_args: dict | None = None,
              again: LoadPlan | None = None, adapters: list | None = None, preset: dict | None = None) -> LoadPlan:
    """Validate a load and decide node, backend, GPUs and the command; raises LoadRefused.

    Without `node`, every online node is planned and the best kept (placement.choose_node).
    `again`: the plan made before on its node, made again there (under the node's placement lock,
    with the GPU rooms as they are now), reusing what cannot have changed: the model's source and
    the node's GPU type.
    """
    if server_type not in InstanceType.values:
        raise LoadRefused(400, f"server_type must be llm, embedding or rerank, not {str(server_type)[:40]!r}")
    kwargs = dict(model_path=model_path, model_name=model_name, server_type=server_type, backend=backend,
                  gpus=gpus, tensor_parallel_size=tensor_parallel_size, extra_args=extra_args, adapters=adapters,
                  preset=preset)
    if again is not None:
        return _plan_on(pick_node(again.node.name), source=again.source, node_type=_plan_gpu_type(again), **kwargs)
    if node:
        return _plan_on(pick_node(node), **kwargs)
    candidates = list(Node.placeable())
    if not candidates:
        raise LoadRefused(409, "no node agent is online to run the model", code="node_offline")
    if len(candidates) == 1:
        return _plan_on(candidates[0], **kwargs)
    options: list[NodeOption] = []
    refusals: list[LoadRefused] = []
    for candidate in candidates:
        try:
            plan = _plan_on(candidate, **kwargs)
        except LoadRefused as exc:
            if exc.status == 400 and exc.code not in ("backend_unavailable", "does_not_fit"):
                raise  # a bad request is bad on every node
            refusals.append(exc)
            continue
        options.append(NodeOption(node=candidate, gpus=plan.gpus, payload=plan))
    if not options:
        worst = max(refusals, key=lambda e: e.status)
        reasons = "; ".join(f"{e}" for e in refusals)
        raise LoadRefused(worst.status, f"no online node can run it: {reasons}", code=worst.code,
                          retry_after=worst.retry_after)
    first: LoadPlan = options[0].payload
    best, why = choose_node(options, model_path=first.source.model_path, from_store=first.source.kind == "prefix")
    plan: LoadPlan = best.payload
    return LoadPlan(plan.source, plan.node, plan.launch, plan.estimate, plan.extra_args, placement=why)


def plan_replica_on(target: Node, *, avoid_gpus: frozenset[int], **kwargs) -> LoadPlan:
    """One more replica's plan on `target`, made as a load's (placement, estimate, backend verdict,
    the command), on GPUs no replica of the model holds there; raises LoadRefused."""
    return _plan_on(target, avoid_gpus=avoid_gpus, **kwargs)


def _plan_on(target: Node, *, model_path: str, model_name: str | None, server_type: str, backend: str | None,
             gpus: list[int] | None, tensor_parallel_size: int | None, extra_args: dict | None,
             source: ModelSource | None = None, node_type: str | None = None,
             avoid_gpus: frozenset[int] = frozenset(), adapters: list | None = None,
             preset: dict | None = None) -> LoadPlan:
    """The plan for one node; raises LoadRefused."""
    current = wait_for_inventory(target, timeout_s=settings.INVENTORY_WAIT_S)
    if current is None:  # the agent restarted and its probe has not replaced the last run's inventory
        raise LoadRefused(503, f"node {target.name}'s agent has just started and has not saved its hardware and "
                               "backends yet; try again in a few seconds", code="node_starting", retry_after=5)
    target = current
    if not target.detector and not target.backends:
        raise LoadRefused(409, f"node {target.name} has not reported its hardware and backends yet (its agent is "
                               "still starting); try again in a few seconds", code="node_not_ready")
    source = source or resolve_source(model_path, on_this_node=target.name == settings.NODE_NAME)
    name = (model_name or "").strip() or default_model_name(source)
    if not MODEL_NAME_RE.match(name):
        raise LoadRefused(400, f"model_name {name[:80]!r} may use letters, digits and . _ : / - (max 128)")
    checked = None
    if adapters:
        if server_type != InstanceType.LLM:
            raise LoadRefused(400, "LoRA adapters go with an llm model only", code="adapters_unsupported")
        try:
            checked = check_adapters(adapters, fmt=source.fmt, base_local=source.local_path,
                                     on_this_node=target.name == settings.NODE_NAME)
        except ValueError as exc:  # serving.control.lora.LoadRefused
            raise LoadRefused(getattr(exc, "status", 400), str(exc), code=getattr(exc, "code", "invalid_request")) \
                from None
    launch, estimate, extra = make_launch_plan(
        node=target, source=source, model_name=name, server_type=server_type, backend=backend, gpus=gpus,
        tensor_parallel_size=tensor_parallel_size, extra_args=extra_args, node_type=node_type, avoid_gpus=avoid_gpus,
        adapters=checked, preset=preset)
    return LoadPlan(source, target, launch, estimate, extra, placement=f"on {target.name}")


# ---------------------------------------------------------------- plans of stored instances
def stored_plan(inst: ModelInstance) -> LaunchPlan | None:
    """The plan stored on the instance, or None (an instance from before plans, or an unreadable one)."""
    if not inst.plan:
        return None
    try:
        return LaunchPlan.from_json(inst.plan)
    except ValueError:
        return None


def load_ctx(extra_args: dict | None) -> int:
    """The context size a load asks for (0: the backend's default)."""
    extra = extra_args or {}
    ctx = next((extra[f] for f in CTX_FLAGS if extra.get(f)), None)
    try:
        return int(ctx) if ctx else 0
    except (TypeError, ValueError):
        return 0


def plan_ctx(plan: LaunchPlan, extra_args: dict | None) -> int:
    """The context a plan runs with, as memory measurements are keyed: the one it recorded, else
    (a plan made before it recorded one) the load's own (0: the engine's default)."""
    return plan.context or load_ctx(extra_args)


def with_measurement(estimate: MemoryEstimate, *, model_path: str, backend: str, ctx: int,
                     tensor_parallel_size: int) -> MemoryEstimate:
    """The measured figure of the same load shape in place of the estimate, when one was recorded."""
    from django.utils.timesince import timesince

    from serving.models import MemoryMeasurement

    m = MemoryMeasurement.objects.filter(model_path=model_path, backend=backend, ctx=ctx,
                                         tensor_parallel_size=tensor_parallel_size).first()
    if m is None:
        return estimate
    note = f"measured {m.measured_mib} MiB on {m.node_name}, {timesince(m.measured_at).split(',')[0]} ago"
    return dataclasses.replace(estimate, total_mib=int(m.measured_mib), measured=note,
                               detail=f"{note} ({m.source}); the estimate was ~{gib(estimate.total_mib)}: "
                                      f"{estimate.detail}")


def record_measurement(instance_id: int, *, plan: LaunchPlan, extra_args: dict, measured_mib: int, source: str,
                       node_name: str) -> None:
    """What the instance holds once READY: on the instance, and for the next load of its shape."""
    from django.utils import timezone

    from serving.models import MemoryMeasurement

    ModelInstance.objects.filter(pk=instance_id).update(measured_memory_mib=measured_mib, measured_source=source)
    MemoryMeasurement.objects.update_or_create(
        model_path=plan.model_path, backend=f"{plan.backend} ({plan.flavour})", ctx=plan_ctx(plan, extra_args),
        tensor_parallel_size=plan.tensor_parallel_size,
        defaults={"measured_mib": measured_mib, "source": source, "node_name": node_name,
                  "measured_at": timezone.now()})


def backends_for(plan: LoadPlan) -> list[dict]:
    """Every backend and whether it can run the planned model on the plan's node (the Load dialog)."""
    node = plan.node
    return backend_options(fmt=plan.source.fmt, gpu_type=_plan_gpu_type(plan), backends=node.backends,
                           server_type=plan.launch.server_type, node_name=node.name)


def fallback_plan(inst: ModelInstance, failed: LaunchPlan) -> tuple[LaunchPlan | None, str]:
    """The plan on the next backend of the node that can serve the instance's model, after
    `failed` did not come up; (None, why not) when there is none or it may not fall back."""
    if not failed.fallback or failed.fell_back_from:
        return None, "" if not failed.fallback else f"{failed.fell_back_from} failed before it"
    if not settings.BACKEND_FALLBACK:
        return None, "fallback is off (XGEN_BACKEND_FALLBACK=false)"
    node = inst.node
    node_type = _gpu_type_of(node)
    others = fallback_backends(fmt=failed.format, gpu_type=node_type, backends=node.backends,
                               server_type=failed.server_type, failed=failed.backend)
    if not others:
        return None, f"no other backend on {node.name} serves it"
    if inst.model_path.startswith("/"):
        source = resolve_source(inst.model_path, on_this_node=True)
    else:
        artifact = inst.artifact if inst.artifact_id else None
        source = ModelSource(inst.model_path, "prefix", failed.format, None, artifact,
                             artifact.size_bytes if artifact else 0)
    why = []
    for name in others:
        try:
            plan, _, _ = make_launch_plan(
                node=node, source=source, model_name=inst.model_name, server_type=failed.server_type, backend=name,
                gpus=None, tensor_parallel_size=failed.tensor_parallel_size, extra_args=inst.extra_args,
                placed_gpus=list(failed.gpus), node_type=node_type, adapters=list(inst.adapters or []),
                preset=inst.preset, instance_id=inst.pk)
        except LoadRefused as exc:
            why.append(f"{name}: {exc.message}")
            continue
        return dataclasses.replace(plan, fallback=False, fell_back_from=failed.backend,
                                   reason=f"{failed.backend} did not come up; fallback to {name} ({plan.flavour})"), ""
    return None, "; ".join(why)


def replan_instance(inst: ModelInstance, extra_args: dict | None) -> tuple[LaunchPlan, dict]:
    """The instance's plan made again where it runs (its node, backend as the node has it now: a
    new version is picked up, its GPUs as recorded), with `extra_args`: a rolling restart's
    (issue 30 #4). (plan, normalized extra_args); raises LoadRefused (bad extra_args, backend gone)."""
    old = stored_plan(inst)
    if inst.model_path.startswith("/"):
        source = resolve_source(inst.model_path, on_this_node=inst.node.name == settings.NODE_NAME)
    else:
        artifact = inst.artifact if inst.artifact_id else None
        fmt = artifact.format if artifact else inst.model_path.split("/", 1)[0]
        source = ModelSource(inst.model_path, "prefix", fmt, None, artifact, artifact.size_bytes if artifact else 0)
    plan, _, extra = make_launch_plan(
        node=inst.node, source=source, model_name=inst.model_name, server_type=inst.type, backend=inst.backend,
        gpus=None, tensor_parallel_size=inst.tensor_parallel_size, extra_args=extra_args,
        placed_gpus=list(inst.gpus or (old.gpus if old else ())), adapters=list(inst.adapters or []),
        preset=inst.preset, instance_id=inst.pk)
    return dataclasses.replace(plan, fallback=bool(old and old.fallback)), extra


LLAMA_CPP_ENGINES = ("llama-server", "llama-cpp-python")


def cpu_backends_on(node: Node, *, besides: int | None = None) -> int:
    """llama.cpp backends that run (or start) on `node`'s CPU, holding no GPU (`besides`: one not
    to count): the ones a new CPU backend there shares the cores with."""
    rows = ModelInstance.objects.filter(node=node, state__in=ACTIVE_STATES, desired_state=DesiredState.RUNNING,
                                        backend__in=LLAMA_CPP_ENGINES).exclude(pk=besides).values_list("gpus", flat=True)
    return sum(1 for gpus in rows if not gpus)


def plan_for_instance(inst: ModelInstance) -> LaunchPlan:
    """The instance's plan; one from before plans existed (0.1.0) is made now, on its node, from
    its row (backend, GPUs, tensor parallel size and extra_args as recorded; GPUs are placed
    afresh only when the row holds none), and stored.
    Raises LoadRefused when it cannot be made (backend gone, model path missing, bad extra_args)."""
    plan = stored_plan(inst)
    if plan is not None:
        return plan
    if inst.model_path.startswith("/"):
        source = resolve_source(inst.model_path, on_this_node=True)
    else:
        artifact = inst.artifact if inst.artifact_id else None
        fmt = artifact.format if artifact else inst.model_path.split("/", 1)[0]
        source = ModelSource(inst.model_path, "prefix", fmt, None, artifact, artifact.size_bytes if artifact else 0)
    plan, _, _ = make_launch_plan(
        node=inst.node, source=source, model_name=inst.model_name, server_type=inst.type, backend=inst.backend,
        gpus=None, tensor_parallel_size=inst.tensor_parallel_size, extra_args=inst.extra_args,
        placed_gpus=list(inst.gpus) if inst.gpus else None, adapters=list(inst.adapters or []),
        preset=inst.preset, instance_id=inst.pk)
    ModelInstance.objects.filter(pk=inst.pk).update(plan=plan.to_json())
    inst.plan = plan.to_json()
    return plan
