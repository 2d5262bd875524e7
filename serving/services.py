"""Writes for model instances: load/unload/restart requests (web side) and the one function
every state change goes through (agent side).

The database holds the desired state; the node agent's supervisor reconciles it. A request
only validates, writes the row, and nudges the agent of the instance's node.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from hardware.models import GpuDevice, Node
from hub.models import CacheEntry, CacheState, ModelArtifact
from serving import events
from serving.adapters import InvalidExtraArgs, get_adapter
from serving.models import (
    ACTIVE_STATES,
    DesiredState,
    InstanceEvent,
    InstanceState,
    InstanceType,
    ModelInstance,
)
from serving.placement import (
    GpuRoom,
    MemoryEstimate,
    PlacementError,
    assign_gpus,
    estimate_memory,
)
from serving.selection import BackendChoice, BackendUnavailable, choose_backend, node_gpu_type

log = logging.getLogger("xgen.serving")

MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
PREFIX_RE = re.compile(r"^(gguf|huggingface)/[A-Za-z0-9][A-Za-z0-9._-]{0,200}(/[A-Za-z0-9][A-Za-z0-9._-]{0,200})*$")
# States still holding GPU memory that the detector may not show yet.
RESERVING_STATES = (InstanceState.PENDING, InstanceState.CACHING, InstanceState.LOADING, InstanceState.WARMING)


class LoadRefused(Exception):
    """A request that cannot be done; `status` is the HTTP status the API answers with."""

    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


# ---------------------------------------------------------------- the one state-change function
def transition(instance_id: int, to_state: str, message: str = "", *, event: bool = True, **fields) -> ModelInstance:
    """Set an instance's state (and other fields), record an InstanceEvent, publish the live update.

    Every state change goes through here. `event=False` updates without a timeline row (progress).
    """
    with transaction.atomic():
        inst = ModelInstance.objects.select_for_update().select_related("node").get(pk=instance_id)
        from_state = inst.state
        inst.state = to_state
        inst.state_message = message[:500]
        inst.updated_at = timezone.now()
        for name, value in fields.items():
            setattr(inst, name, value)
        inst.save()
        ev = None
        if event:
            ev = InstanceEvent.objects.create(instance=inst, from_state=from_state, to_state=to_state, message=message)
    try:
        events.state_changed(inst, ev)
    except Exception:  # a live update must never break a state change
        log.warning("live update for %s failed", inst, exc_info=True)
    return inst


def save_log_tail(instance_id: int, lines: list[str]) -> None:
    ModelInstance.objects.filter(pk=instance_id).update(log_tail=lines[-50:])


# ---------------------------------------------------------------- model source
@dataclass(frozen=True)
class ModelSource:
    model_path: str  # as given (normalized)
    kind: str  # "prefix" | "path"
    fmt: str  # gguf | huggingface
    local_path: Path | None  # a file or dir readable here (for the estimate), if any
    artifact: ModelArtifact | None
    size_bytes: int


def _validate_prefix(prefix: str) -> str:
    try:
        from hub.paths import InvalidPrefix, validate_prefix
    except ImportError:  # the hub's validator lands separately; same rules here meanwhile
        if not PREFIX_RE.match(prefix) or ".." in prefix.split("/"):
            raise LoadRefused(400, f"'{prefix[:120]}' is not a valid store prefix (like gguf/Name)") from None
        return prefix
    try:
        return validate_prefix(prefix)
    except InvalidPrefix as exc:
        raise LoadRefused(400, f"'{prefix[:120]}' is not a valid store prefix: {exc}") from None


def gguf_in_dir(path: Path) -> Path | None:
    files = sorted(path.glob("*.gguf"))
    return files[0] if files else None


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
        path = Path(raw)
        if on_this_node:
            if not path.exists():
                raise LoadRefused(400, f"no file or directory at {raw[:200]} on this node")
            if path.is_file():
                if path.suffix != ".gguf":
                    raise LoadRefused(400, f"{raw[:200]} is not a .gguf file (give a .gguf file or a model directory)")
                return ModelSource(raw, "path", "gguf", path, None, path.stat().st_size)
            if (path / "config.json").is_file():
                size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
                return ModelSource(raw, "path", "huggingface", path, None, size)
            found = gguf_in_dir(path)
            if found:
                return ModelSource(raw, "path", "gguf", found, None, found.stat().st_size)
            raise LoadRefused(400, f"{raw[:200]} has neither config.json nor a .gguf file")
        fmt = "gguf" if raw.endswith(".gguf") else "huggingface"
        return ModelSource(raw, "path", fmt, None, None, 0)
    if raw.startswith("~") or "\\" in raw:
        raise LoadRefused(400, "model_path must be a store prefix (gguf/..., huggingface/...) or an absolute path")
    prefix = _validate_prefix(raw)
    artifact = ModelArtifact.objects.filter(prefix=prefix).first()
    if artifact is not None:
        if not artifact.complete:
            raise LoadRefused(409, f"{prefix} is still being written to the store; try again when it is complete")
        return ModelSource(prefix, "prefix", artifact.format, None, artifact, artifact.size_bytes)
    manifest = _store_manifest(prefix)  # not indexed yet: the store is the source of truth
    if manifest is None:
        raise LoadRefused(400, f"no model {prefix!r} in the store (see /api/storage/models)", code="model_not_found")
    return ModelSource(prefix, "prefix", prefix.split("/", 1)[0], None, None, manifest.size_bytes)


def _store_manifest(prefix: str):
    try:
        from hub.store import get_store

        return get_store().read_manifest(prefix)
    except Exception as exc:  # an unreachable store is a clear refusal, not a 500
        raise LoadRefused(503, f"the model store cannot be read: {exc.__class__.__name__}: {exc}",
                          code="store_unavailable") from None


def default_model_name(source: ModelSource) -> str:
    base = PurePosixPath(source.model_path).name
    if base.endswith(".gguf"):
        base = base[: -len(".gguf")]
    name = re.sub(r"[^A-Za-z0-9._:/-]", "-", base).strip("-.") or "model"
    return name[:128]


# ---------------------------------------------------------------- planning (shared by the API and the Load page)
@dataclass(frozen=True)
class LoadPlan:
    source: ModelSource
    model_name: str
    server_type: str
    node: Node
    choice: BackendChoice
    gpus: list[int]
    fit: str
    estimate: MemoryEstimate
    extra_args: dict
    tensor_parallel_size: int
    command: list[str]
    placement: str = ""


def pick_node(name: str | None) -> Node:
    if name:
        node = Node.objects.filter(name=name).first()
        if node is None:
            raise LoadRefused(400, f"unknown node {name!r}", code="node_not_found")
        if not node.is_online:
            raise LoadRefused(409, f"node {name} is {node.status}: its agent has not heartbeated "
                                   f"for {int(node.heartbeat_age_s or 0)} s", code="node_offline")
        return node
    fresh = list(Node.fresh())
    if not fresh:
        raise LoadRefused(409, "no node agent is online to run the model", code="node_offline")
    local = [n for n in fresh if n.name == settings.NODE_NAME]
    return (local or fresh)[0]


def gpu_rooms(node: Node, *, exclude_instance: int | None = None) -> list[GpuRoom]:
    """Free memory per GPU, minus what loading instances have claimed but not yet allocated."""
    reserved: dict[int, float] = {}
    pending = ModelInstance.objects.filter(node=node, state__in=RESERVING_STATES).exclude(pk=exclude_instance)
    for inst in pending:
        if inst.gpus and inst.estimated_memory_mib:
            for idx in inst.gpus:
                reserved[idx] = reserved.get(idx, 0) + inst.estimated_memory_mib / len(inst.gpus)
    return [
        GpuRoom(g.index, max(0, int(g.memory_free_mib - reserved.get(g.index, 0))), g.memory_total_mib)
        for g in GpuDevice.objects.filter(node=node).order_by("index")
    ]


def plan_load(*, model_path: str, model_name: str | None = None, server_type: str = "llm",
              backend: str | None = None, node: str | None = None, gpus: list[int] | None = None,
              tensor_parallel_size: int | None = None, extra_args: dict | None = None) -> LoadPlan:
    """Validate a load and work out node, backend, GPUs and the command; raises LoadRefused.

    Without `node`, every online node is planned and the best kept: one that already caches
    the model first, then the one with the most memory left where the model would run.
    """
    if server_type not in (InstanceType.LLM, InstanceType.EMBEDDING):
        raise LoadRefused(400, f"server_type must be llm or embedding, not {str(server_type)[:40]!r}")
    kwargs = dict(model_path=model_path, model_name=model_name, server_type=server_type, backend=backend,
                  gpus=gpus, tensor_parallel_size=tensor_parallel_size, extra_args=extra_args)
    if node:
        return _plan_on(pick_node(node), **kwargs)
    candidates = list(Node.fresh())
    if not candidates:
        raise LoadRefused(409, "no node agent is online to run the model", code="node_offline")
    if len(candidates) == 1:
        return _plan_on(candidates[0], **kwargs)
    plans: list[tuple] = []  # (rank, plan, cached, room)
    refusals: list[LoadRefused] = []
    for candidate in candidates:
        try:
            plan = _plan_on(candidate, **kwargs)
        except LoadRefused as exc:
            if exc.status == 400 and exc.code not in ("backend_unavailable", "does_not_fit"):
                raise  # a bad request is bad on every node
            refusals.append(exc)
            continue
        cached = plan.source.kind == "prefix" and CacheEntry.objects.filter(
            node=candidate, prefix=plan.source.model_path, state=CacheState.READY).exists()
        room = sum(r.free_mib for r in gpu_rooms(candidate) if r.index in plan.gpus) if plan.gpus else \
            max(0, candidate.memory_total_mib - candidate.memory_used_mib)
        plans.append(((0 if cached else 1, -room, candidate.name), plan, bool(cached), room))
    if not plans:
        worst = max(refusals, key=lambda e: e.status)
        reasons = "; ".join(f"{e}" for e in refusals)
        raise LoadRefused(worst.status, f"no online node can run it: {reasons}", code=worst.code)
    plans.sort(key=lambda item: item[0])
    _, best, cached, room = plans[0]
    why = "it already caches the model" if cached else f"it has the most room ({room / 1024:.1f} GiB free)"
    others = len(plans) - 1
    placement = f"placed on {best.node.name}: {why}" + (f" ({others} other node(s) could run it)" if others else "")
    return dataclasses.replace(best, placement=placement)


def _plan_on(target: Node, *, model_path: str, model_name: str | None, server_type: str, backend: str | None,
             gpus: list[int] | None, tensor_parallel_size: int | None, extra_args: dict | None) -> LoadPlan:
    """The plan for one node; raises LoadRefused."""
    from serving.adapters.base import LaunchSpec

    if not target.detector and not target.backends:
        raise LoadRefused(409, f"node {target.name} has not reported its hardware and backends yet (its agent is "
                               "still starting); try again in a few seconds", code="node_not_ready")
    source = resolve_source(model_path, on_this_node=target.name == settings.NODE_NAME)
    name = (model_name or "").strip() or default_model_name(source)
    if not MODEL_NAME_RE.match(name):
        raise LoadRefused(400, f"model_name {name[:80]!r} may use letters, digits and . _ : / - (max 128)")
    gpu_type = node_gpu_type(list(GpuDevice.objects.filter(node=target).values_list("type", flat=True)))
    try:
        choice = choose_backend(fmt=source.fmt, gpu_type=gpu_type, backends=target.backends,
                                requested=backend, node_name=target.name)
    except BackendUnavailable as exc:
        raise LoadRefused(400, str(exc), code="backend_unavailable") from None
    adapter = get_adapter(choice.backend)
    try:
        extra = adapter.normalize_extra_args(extra_args, choice.version)
    except InvalidExtraArgs as exc:
        raise LoadRefused(400, str(exc), code="invalid_extra_args") from None
    tp = tensor_parallel_size or 1
    if tp < 1 or tp > 64:
        raise LoadRefused(400, "tensor_parallel_size must be 1..64")
    ctx = extra.get("--ctx-size") or extra.get("--n_ctx") or extra.get("--max-model-len")
    estimate = estimate_memory(source.local_path, fmt=source.fmt, size_bytes=source.size_bytes,
                               ctx=int(ctx) if ctx else None)
    if choice.uses_gpu:
        try:
            chosen, fit = assign_gpus(node_name=target.name, gpus=gpu_rooms(target), need_mib=estimate.total_mib,
                                      requested=gpus or None, tensor_parallel_size=tp)
        except PlacementError as exc:
            raise LoadRefused(409, str(exc), code="does_not_fit") from None
    else:
        if gpus:
            raise LoadRefused(400, f"{choice.backend} ({choice.flavour}) runs on the CPU; do not pick GPUs")
        chosen, fit = [], f"runs on the CPU of {target.name}: needs ~{estimate.total_mib / 1024:.1f} GiB of RAM"
    gpu_kind = gpu_type if chosen else ""
    spec = LaunchSpec(
        model_file=source.local_path or Path(source.model_path), model_name=name, server_type=server_type,
        host="127.0.0.1" if target.address in ("", "localhost") else target.address, port=0,
        gpus=tuple(chosen), gpu_type=gpu_kind, flavour=choice.flavour, version=choice.version,
        executable=choice.path, tensor_parallel_size=tp, extra_args=extra,
    )
    return LoadPlan(source, name, server_type, target, choice, chosen, fit, estimate, extra, tp,
                    adapter.build_command(spec), placement=f"on {target.name}")


# ---------------------------------------------------------------- requests (web side)
def nudge_node(node_name: str) -> None:
    """Wake the node's agent now (it would also notice within RECONCILE_INTERVAL_S)."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(events.node_group(node_name), {"type": "agent.nudge"})
    except Exception:
        log.warning("nudging node %s failed; it will reconcile on its own", node_name, exc_info=True)


def name_holders() -> Q:
    """Instances that hold their served name: active ones, and ones the agent will start again."""
    return Q(state__in=ACTIVE_STATES) | (Q(desired_state=DesiredState.RUNNING) & Q(state=InstanceState.STOPPED))


def request_load(*, model_path: str, model_name: str | None = None, server_type: str = "llm",
                 backend: str | None = None, node: str | None = None, gpus: list[int] | None = None,
                 tensor_parallel_size: int | None = None, extra_args: dict | None = None,
                 autostart: bool = False, user=None) -> ModelInstance:
    """Validate and record a load (desired RUNNING, state PENDING), then nudge the node's agent."""
    plan = plan_load(model_path=model_path, model_name=model_name, server_type=server_type, backend=backend,
                     node=node, gpus=gpus, tensor_parallel_size=tensor_parallel_size, extra_args=extra_args)
    with transaction.atomic():
        clash = ModelInstance.objects.select_for_update().filter(model_name=plan.model_name).filter(name_holders())
        if clash.exists():
            other = clash.first()
            raise LoadRefused(409, f"a model named {plan.model_name!r} is already loaded (instance {other.pk}, "
                                   f"{other.state}); unload it or pick another model_name", code="duplicate_model_name")
        inst = ModelInstance.objects.create(
            model_name=plan.model_name, model_path=plan.source.model_path, artifact=plan.source.artifact,
            type=plan.server_type, backend=plan.choice.backend,
            backend_reason=f"{plan.choice.reason} ({plan.placement})",
            node=plan.node, gpus=plan.gpus, tensor_parallel_size=plan.tensor_parallel_size,
            extra_args=plan.extra_args, autostart=autostart, desired_state=DesiredState.RUNNING,
            state=InstanceState.PENDING, state_message="waiting for the node agent",
            estimated_memory_mib=plan.estimate.total_mib, created_by=user if getattr(user, "pk", None) else None,
        )
        ev = InstanceEvent.objects.create(instance=inst, from_state="", to_state=InstanceState.PENDING,
                                          message=f"load requested: {plan.choice.reason}; {plan.fit}")
    events.state_changed(inst, ev)
    nudge_node(plan.node.name)
    return inst


def find_instance(*, id: int | None = None, model_name: str | None = None) -> ModelInstance:
    """The instance by id, or the active one serving `model_name`."""
    qs = ModelInstance.objects.select_related("node")
    if id is not None:
        inst = qs.filter(pk=id).first()
        if inst is None:
            raise LoadRefused(404, f"no instance {id}", code="instance_not_found")
        return inst
    if model_name:
        inst = qs.filter(model_name=model_name, state__in=ACTIVE_STATES).first() or \
            qs.filter(model_name=model_name).first()
        if inst is None:
            raise LoadRefused(404, f"no instance serves {model_name[:120]!r}", code="model_not_found")
        return inst
    raise LoadRefused(400, "give id or model_name")


def request_unload(*, instance: ModelInstance) -> ModelInstance:
    """Desired STOPPED; the agent stops the process (an instance not running is marked STOPPED now)."""
    ModelInstance.objects.filter(pk=instance.pk).update(desired_state=DesiredState.STOPPED, autostart=False)
    instance.refresh_from_db()
    if instance.state == InstanceState.ERROR or (instance.state == InstanceState.PENDING and not instance.pid):
        instance = transition(instance.pk, InstanceState.STOPPED, "unloaded", gpus=[], port=None)
    nudge_node(instance.node.name)
    return instance


def request_restart(*, instance: ModelInstance) -> ModelInstance:
    """Stop (if running) and start again; an ERROR or STOPPED instance is started afresh."""
    if instance.state in (InstanceState.STOPPED, InstanceState.ERROR):
        clash = ModelInstance.objects.filter(model_name=instance.model_name).filter(name_holders()) \
            .exclude(pk=instance.pk)
        if clash.exists():
            raise LoadRefused(409, f"another instance now serves {instance.model_name!r}",
                              code="duplicate_model_name")
        instance = transition(instance.pk, InstanceState.PENDING, "restart requested",
                              desired_state=DesiredState.RUNNING, restarts=0, last_error="", exit_code=None)
    else:
        ModelInstance.objects.filter(pk=instance.pk).update(restart_requested=True)
        instance = transition(instance.pk, instance.state, "restart requested", desired_state=DesiredState.RUNNING)
    nudge_node(instance.node.name)
    return instance


def instances_for_node(node_name: str) -> list[ModelInstance]:
    return list(ModelInstance.objects.select_related("node").filter(node__name=node_name).filter(
        Q(desired_state=DesiredState.RUNNING) | Q(state__in=ACTIVE_STATES) | Q(pid__isnull=False)))
