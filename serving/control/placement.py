"""Where an instance runs: the node (ranked when several could), GPUs with room for the model,
the address and a free port its backend listens on.

The memory estimate is deliberately simple and shown with its numbers, so an operator can
see why a model was refused: weights (file size, or params x dtype) + KV cache for the
context + a fixed runtime overhead.
"""
from __future__ import annotations

import json
import socket
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from hardware.models import GpuDevice, Node
from hub.ggufmeta import arch_header, has_kv_shape, hf_arch_header
from hub.models import CacheEntry, CacheState
from serving.models import InstanceState, ModelInstance

MIB = 1024 * 1024
GIB = 1024 * MIB
RUNTIME_OVERHEAD_MIB = 512  # CUDA/ROCm context, compute buffers
DEFAULT_CTX = 4096
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "int8": 1, "fp8": 1}


class PlacementError(ValueError):
    """The model fits on no GPU of the node, or the requested GPUs are wrong (message has the numbers)."""


def gib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB"


@dataclass(frozen=True)
class MemoryEstimate:
    total_mib: int
    weights_mib: int
    kv_mib: int
    overhead_mib: int
    detail: str
    measured: str = ""  # "measured 612 MiB on vm, 2 days ago" when the figure is a measurement

    @property
    def label(self) -> str:
        return self.measured or f"~{gib(self.total_mib)}"


def _kv_mib(n_layers: int, ctx: int, n_embd: int, n_head: int, n_head_kv: int, bytes_per: int = 2) -> int:
    kv_dim = n_embd * n_head_kv // max(n_head, 1)
    return int(2 * n_layers * ctx * kv_dim * bytes_per / MIB)


def gguf_header(path: Path) -> dict:
    """n_layers, context length, embedding size and heads from a GGUF header ({} if unreadable).
    Read by hub.ggufmeta, which stops once it has them (gguf-py's reader parsed the whole
    vocabulary first: 4.1-4.7 s on the demo model, on every load)."""
    return arch_header(path)


def estimate_gguf(path: Path, *, ctx: int | None = None) -> MemoryEstimate:
    """File size + KV cache (f16) for the context + overhead."""
    return estimate_gguf_head(gguf_header(path), int(path.stat().st_size / MIB) + 1, ctx=ctx)


def estimate_gguf_head(head: dict, weights_mib: int, *, ctx: int | None = None) -> MemoryEstimate:
    """Weights + KV cache (f16) for `ctx` (default: the model's context up to DEFAULT_CTX) + overhead,
    from a GGUF header read on this disk or from the store."""
    weights = weights_mib
    # llama.cpp allocates the KV cache for the context asked for, even beyond the trained one.
    n_ctx = ctx or min(DEFAULT_CTX, int(head.get("ctx") or DEFAULT_CTX))
    kv = 0
    if head.get("n_layers") and head.get("n_embd"):
        n_head = int(head.get("n_head") or 1)
        kv = _kv_mib(int(head["n_layers"]), n_ctx, int(head["n_embd"]), n_head, int(head.get("n_head_kv") or n_head))
    detail = f"weights {gib(weights)} + KV cache {gib(kv)} for {n_ctx} tokens + overhead {gib(RUNTIME_OVERHEAD_MIB)}"
    return MemoryEstimate(weights + kv + RUNTIME_OVERHEAD_MIB, weights, kv, RUNTIME_OVERHEAD_MIB, detail)


def hf_header(config_path: Path) -> dict:
    """gguf_header's keys from a Hugging Face config.json on this disk (hub.ggufmeta.hf_arch_header);
    {} when it cannot be read. The trained context is max_position_embeddings."""
    try:
        return hf_arch_header(json.loads(config_path.read_text()))
    except (OSError, ValueError):
        return {}


def estimate_hf_dir(path: Path, *, ctx: int | None = None) -> MemoryEstimate:
    """estimate_hf_config from the folder's config.json, with its safetensors' size."""
    cfg = hf_header(path / "config.json").get("config")
    if not cfg:
        raise ValueError(f"{path}/config.json says nothing of the model's size")  # estimate_memory falls back
    on_disk = int(sum(p.stat().st_size for p in path.glob("*.safetensors")) / MIB)
    return estimate_hf_config(cfg, on_disk, ctx=ctx)


def estimate_hf_config(cfg: dict, on_disk_mib: int, *, ctx: int | None = None) -> MemoryEstimate:
    """Params from a config.json's sizes (hub.ggufmeta.HF_CONFIG_KEYS) x dtype (or the weights'
    size on disk if larger) + KV cache + overhead."""
    hidden = int(cfg.get("hidden_size", 0))
    layers = int(cfg.get("num_hidden_layers", 0))
    inter = int(cfg.get("intermediate_size", 4 * hidden))
    vocab = int(cfg.get("vocab_size", 32000))
    n_head = int(cfg.get("num_attention_heads", 1))
    n_kv = int(cfg.get("num_key_value_heads", n_head))
    dtype = DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), 2)
    attn = hidden * hidden * 2 + 2 * hidden * (hidden * n_kv // max(n_head, 1))
    params = layers * (attn + 3 * hidden * inter) + vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    weights = max(int(params * dtype / MIB), on_disk_mib)
    n_ctx = min(ctx or DEFAULT_CTX, int(cfg.get("max_position_embeddings") or DEFAULT_CTX))
    kv = _kv_mib(layers, n_ctx, hidden, n_head, n_kv, bytes_per=dtype) if layers and hidden else 0
    detail = (f"{params / 1e9:.2f} B params x {dtype} bytes = {gib(weights)} + KV cache {gib(kv)} "
              f"for {n_ctx} tokens + overhead {gib(RUNTIME_OVERHEAD_MIB)}")
    return MemoryEstimate(weights + kv + RUNTIME_OVERHEAD_MIB, weights, kv, RUNTIME_OVERHEAD_MIB, detail)


def estimate_from_size(size_bytes: int) -> MemoryEstimate:
    """For a store model not on this disk yet: its size + 15% for KV cache + overhead."""
    weights = int(size_bytes / MIB) + 1
    kv = int(weights * 0.15)
    return MemoryEstimate(weights + kv + RUNTIME_OVERHEAD_MIB, weights, kv, RUNTIME_OVERHEAD_MIB,
                          f"store size {gib(weights)} + ~15% KV cache + overhead {gib(RUNTIME_OVERHEAD_MIB)}")


def estimate_memory(path: Path | None, *, fmt: str, size_bytes: int = 0, ctx: int | None = None,
                    header: dict | None = None) -> MemoryEstimate:
    """The best estimate available: from the files when they are here, else from a GGUF's header
    read from the store (`header`) and its size, else from the store size alone."""
    try:
        if path is not None and fmt == "gguf" and path.is_file():
            if header and has_kv_shape(header):  # read already (the plan's context choice): not again
                return estimate_gguf_head(header, int(path.stat().st_size / MIB) + 1, ctx=ctx)
            return estimate_gguf(path, ctx=ctx)
        if fmt == "gguf" and header and has_kv_shape(header) and size_bytes:
            return estimate_gguf_head(header, int(size_bytes / MIB) + 1, ctx=ctx)
        if fmt == "huggingface" and header and isinstance(header.get("config"), dict) and header["config"]:
            return estimate_hf_config(header["config"], int(size_bytes / MIB), ctx=ctx)  # from the store's config.json
        if path is not None and fmt == "huggingface" and (path / "config.json").is_file():
            return estimate_hf_dir(path, ctx=ctx)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return estimate_from_size(size_bytes)


@dataclass(frozen=True)
class GpuRoom:
    index: int
    free_mib: int
    total_mib: int


# States still holding GPU memory that the detector may not show yet.
RESERVING_STATES = (InstanceState.PENDING, InstanceState.CACHING, InstanceState.LOADING, InstanceState.WARMING)


def gpu_rooms(node: Node, *, exclude_instance: int | None = None, evictable_free: bool = False) -> list[GpuRoom]:
    """Free memory per GPU, minus what loading instances have claimed but not yet allocated.
    `evictable_free`: what unpinned on_demand READY instances hold counts as free (a start
    evicts them: serving.control.capacity)."""
    reserved: dict[int, float] = {}
    pending = ModelInstance.objects.filter(node=node, state__in=RESERVING_STATES).exclude(pk=exclude_instance)
    for inst in pending:
        if inst.gpus and inst.estimated_memory_mib:
            for idx in inst.gpus:
                reserved[idx] = reserved.get(idx, 0) + inst.estimated_memory_mib / len(inst.gpus)
    if evictable_free:
        for inst in ModelInstance.objects.filter(node=node, state=InstanceState.READY, policy="on_demand",
                                                 pinned=False).exclude(pk=exclude_instance):
            for idx in inst.gpus or []:
                reserved[idx] = reserved.get(idx, 0) - inst.memory_mib / len(inst.gpus)
    return [
        GpuRoom(g.index, max(0, int(g.memory_free_mib - reserved.get(g.index, 0))), g.memory_total_mib)
        for g in GpuDevice.objects.filter(node=node).order_by("index")
    ]


def ram_room(node: Node, *, exclude_instance: int | None = None) -> int | None:
    """RAM a model on the node's CPU may take (None: the node reports none), counted as gpu_rooms
    counts a GPU's: available now, less what loading CPU instances claimed, plus what unpinned
    on_demand READY ones hold (a start evicts them); within XGEN_NODE_MEMORY_MIB less what the
    node's other models hold, when the node sets it."""
    others = ModelInstance.objects.filter(node=node).exclude(pk=exclude_instance)
    on_cpu = [i for i in others.filter(state__in=RESERVING_STATES + (InstanceState.READY,)) if not i.gpus]
    loading = sum(i.memory_mib for i in on_cpu if i.state != InstanceState.READY)
    evictable = sum(i.memory_mib for i in on_cpu
                    if i.state == InstanceState.READY and i.policy == "on_demand" and not i.pinned)
    room = node.memory_total_mib - node.memory_used_mib - loading + evictable if node.memory_total_mib else None
    if node.model_memory_mib:
        held = sum(i.memory_mib for i in on_cpu) - evictable
        cap = node.model_memory_mib - held
        room = cap if room is None else min(room, cap)
    return max(0, room) if room is not None else None


def assign_gpus(*, node_name: str, gpus: list[GpuRoom], need_mib: int, requested: list[int] | None,
                tensor_parallel_size: int = 1) -> tuple[list[int], str]:
    """GPU indexes for the instance and the verdict line; raises PlacementError with the numbers.

    A CPU node (no GPUs) gets [] and a CPU verdict.
    """
    if not gpus:
        if requested:
            raise PlacementError(f"{node_name} has no GPUs, but GPUs {requested} were requested")
        return [], f"runs on the CPU of {node_name} (no GPU there): needs ~{gib(need_mib)} of RAM"
    by_index = {g.index: g for g in gpus}
    tp = max(1, tensor_parallel_size)
    if requested:
        unknown = [i for i in requested if i not in by_index]
        if unknown:
            raise PlacementError(f"{node_name} has no GPU {unknown[0]} (it has {sorted(by_index)})")
        if len(set(requested)) != len(requested):
            raise PlacementError("a GPU is listed twice")
        chosen = [by_index[i] for i in requested]
        per = need_mib / len(chosen)
        short = [g for g in chosen if g.free_mib < per]
        if short:
            g = short[0]
            raise PlacementError(f"needs ~{gib(per)} per GPU, GPU {g.index} of {node_name} has {gib(g.free_mib)} free")
        where = ", ".join(str(g.index) for g in chosen)
        return [g.index for g in chosen], (f"fits on GPU {where} of {node_name}: needs ~{gib(need_mib)} "
                                           f"of {gib(sum(g.free_mib for g in chosen))} free")
    if tp > len(gpus):
        raise PlacementError(f"tensor parallel size {tp} needs {tp} GPUs; {node_name} has {len(gpus)}")
    ranked = sorted(gpus, key=lambda g: (-g.free_mib, g.index))[:tp]
    per = need_mib / tp
    if ranked[-1].free_mib < per:
        best = ranked[0]
        if tp == 1:
            raise PlacementError(f"needs ~{gib(need_mib)}, largest free is {gib(best.free_mib)} "
                                 f"on gpu {best.index} of {node_name}")
        raise PlacementError(f"needs ~{gib(per)} on each of {tp} GPUs; only {gib(ranked[-1].free_mib)} free "
                             f"on gpu {ranked[-1].index} of {node_name}")
    chosen = sorted(g.index for g in ranked)
    where = ", ".join(str(i) for i in chosen)
    free = sum(g.free_mib for g in ranked)
    return chosen, f"fits on GPU {where} of {node_name}: needs ~{gib(need_mib)} of {gib(free)} free"


@dataclass(frozen=True)
class NodeOption:
    """A node that could run the model, with what it was planned to use there."""

    node: Node
    gpus: list[int]
    payload: Any  # the caller's plan for this node, handed back with the winner


def choose_node(options: Sequence[NodeOption], *, model_path: str, from_store: bool) -> tuple[NodeOption, str]:
    """The best of several nodes and why: one that already caches the model first, then the one
    with the most memory left where the model would run (its GPUs, else its RAM), then by name."""
    ranked = []
    for opt in options:
        cached = from_store and CacheEntry.objects.filter(node=opt.node, prefix=model_path,
                                                          state=CacheState.READY).exists()
        if opt.gpus:
            room = sum(r.free_mib for r in gpu_rooms(opt.node) if r.index in opt.gpus)
        else:
            room = max(0, opt.node.memory_total_mib - opt.node.memory_used_mib)
        ranked.append(((0 if cached else 1, -room, opt.node.name), opt, cached, room))
    ranked.sort(key=lambda item: item[0])
    _, best, cached, room = ranked[0]
    why = "it already caches the model" if cached else f"it has the most room ({room / 1024:.1f} GiB free)"
    others = len(ranked) - 1
    return best, f"placed on {best.node.name}: {why}" + (f" ({others} other node(s) could run it)" if others else "")


def bind_host(node_address: str) -> str:
    """Backends listen only where web processes reach them (the node's address), never on every interface."""
    return "127.0.0.1" if node_address in ("", "localhost") else node_address


def port_bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on `port` now (with SO_REUSEADDR, as servers do: TIME_WAIT is no obstacle)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def pick_port(*, taken: set[int], prefer: int | None = None, spread_by: str = "") -> int:
    """A port in BACKEND_PORT_MIN..MAX not held by another instance and actually bindable now.

    `spread_by` (the node's name) starts the scan at a point of its own, so agents that share one
    host and start backends at the same moment do not race for the same first free port."""
    if prefer and prefer not in taken and settings.BACKEND_PORT_MIN <= prefer <= settings.BACKEND_PORT_MAX \
            and port_bindable(prefer):
        return prefer
    span = settings.BACKEND_PORT_MAX - settings.BACKEND_PORT_MIN + 1
    offset = zlib.crc32(spread_by.encode()) % span if spread_by else 0
    for i in range(span):
        port = settings.BACKEND_PORT_MIN + (offset + i) % span
        if port not in taken and port_bindable(port):
            return port
    raise PlacementError(
        f"no free backend port in {settings.BACKEND_PORT_MIN}-{settings.BACKEND_PORT_MAX}"
    )
