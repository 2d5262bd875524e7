"""LoRA adapters added to or removed from a loaded model (issue 27 #1).

vLLM loads and unloads them at runtime (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`,
with `VLLM_ALLOW_RUNTIME_LORA_UPDATING` in its environment and `--enable-lora` at start): every
READY replica gets the call, and the set is changed only when every one answered 200 (the ones that
took it are told to drop it again when another refused). The stored plan is made again with the
new set, so a replica that restarts later starts with it.

llama-server takes its adapters at start (`--lora-scaled`): a change of the set is a rolling
restart of the model's replicas with the new set (serving.control.rollout), one at a time.

Either way each adapter is a served model `<model>:<adapter>`: the instances' `adapters` change,
which the routing tables of every web process follow (`instance_changed`)."""
from __future__ import annotations

import httpx
from django.conf import settings
from django.db import transaction

from serving.adapters import get_adapter
from serving.control.lora import LoadRefused as AdapterRefused
from serving.control.lora import check_adapters, is_stored
from serving.control.planning import LoadRefused, replan_instance
from serving.control.replicas import live_replicas
from serving.control.rollout import request_rollout
from serving.models import InstanceState, ModelInstance

CALL_TIMEOUT_S = 120.0  # vLLM reads the adapter's weights before it answers


def _replicas(model_name: str) -> list[ModelInstance]:
    live = live_replicas(model_name)
    if not live:
        raise LoadRefused(404, f"no model {model_name[:120]!r} is loaded", code="model_not_found")
    return live


def _post(inst: ModelInstance, path: str, body: dict) -> tuple[int, str]:
    """One call to a replica's engine with its secret: (status, text); (0, why) when it cannot be reached."""
    host = inst.node.address or "127.0.0.1"
    try:
        r = httpx.post(f"http://{host}:{inst.port}{path}", json=body, timeout=CALL_TIMEOUT_S,
                       headers={"Authorization": f"Bearer {inst.backend_key}"} if inst.backend_key else {})
    except httpx.HTTPError as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    return r.status_code, r.text[:500]


def _runtime_ready(live: list[ModelInstance]) -> None:
    """LoadRefused unless every replica is a READY vLLM that can change its adapters now."""
    adapter = get_adapter(live[0].backend)
    for inst in live:
        if inst.state != InstanceState.READY:
            raise LoadRefused(409, f"replica {inst.replica} of {inst.model_name} is {inst.state}: adapters change "
                                   "on READY replicas only; try again once it is READY", code="not_ready")
        plan = inst.plan or {}
        version = str(plan.get("version") or "")
        if not adapter.runtime_adapters(version):
            raise LoadRefused(409, f"{adapter.label} {version} cannot add adapters at runtime (no "
                                   "/v1/load_lora_adapter); unload and load it again with the new set",
                              code="runtime_adapters_unsupported")
        if "--enable-lora" not in (plan.get("argv") or []):
            raise LoadRefused(409, f"{inst.model_name} was started without LoRA (--enable-lora): load it with "
                                   "adapters, or with extra_args --enable-lora, to change them at runtime",
                              code="lora_not_enabled")


def _store(live: list[ModelInstance], adapters: list[dict]) -> None:
    """The new set on every replica, with its plan made again (a restart starts with the set)."""
    with transaction.atomic():
        for inst in live:
            inst.adapters = adapters
            try:
                plan, _ = replan_instance(inst, inst.extra_args)
            except LoadRefused:
                plan = None  # the engine runs with the set; the next start plans it again
            fields = ["adapters", "updated_at"]
            if plan is not None:
                inst.plan = plan.to_json()
                fields.append("plan")
            inst.save(update_fields=fields)  # instance_changed: the routing tables follow


def add_adapter(*, model_name: str, adapter: dict) -> dict:
    """Add `adapter` ({name, path, scale?}) to a loaded model: {applied: "runtime"|"rolling_restart", ...}."""
    live = _replicas(model_name)
    first = live[0]
    engine = get_adapter(first.backend)
    if not engine.supports_adapters:
        raise LoadRefused(400, f"{engine.label} does not load LoRA adapters", code="adapters_unsupported")
    current = [dict(a) for a in first.adapters or []]
    try:
        checked = check_adapters([*current, adapter], fmt=engine.formats[0], base_local=None,
                                 on_this_node=first.node.name == settings.NODE_NAME)
    except AdapterRefused as exc:
        raise LoadRefused(exc.status, exc.message, code=exc.code) from None
    added = checked[-1]
    served = f"{model_name}:{added['name']}"
    from serving.control.services import _duplicate

    clash = _duplicate(served)
    if clash is not None:
        raise clash
    if first.backend != "vllm":
        return _restart_with(live, checked, f"added {served}", served=served)
    if is_stored(added):  # each replica's node copies it from the store first: that is a start's work
        return _restart_with(live, checked, f"added {served} from the store", served=served, why=COPIED_AT_START)
    _runtime_ready(live)
    done: list[ModelInstance] = []
    for inst in live:
        status, text = _post(inst, "/v1/load_lora_adapter", {"lora_name": served, "lora_path": added["path"]})
        if status != 200:
            for took in done:  # all or none: the ones that took it drop it again
                _post(took, "/v1/unload_lora_adapter", {"lora_name": served})
            raise LoadRefused(502, f"replica {inst.replica} of {model_name} ({inst.node.name}:{inst.port}) did not "
                                   f"load {served}: {status or 'unreachable'} {text}".strip(), code="upstream_error")
        done.append(inst)
    _store(live, checked)
    return {"model_name": model_name, "adapter": served, "applied": "runtime", "replicas": [i.pk for i in live]}


def remove_adapter(*, model_name: str, name: str) -> dict:
    """Remove the adapter `name` from a loaded model."""
    live = _replicas(model_name)
    current = [dict(a) for a in live[0].adapters or []]
    kept = [a for a in current if a.get("name") != name]
    served = f"{model_name}:{name}"
    if len(kept) == len(current):
        raise LoadRefused(404, f"{model_name} has no adapter {name[:64]!r}", code="adapter_not_found")
    if live[0].backend != "vllm":
        return _restart_with(live, kept, f"removed {served}", served=served)
    _runtime_ready(live)
    for inst in live:
        status, text = _post(inst, "/v1/unload_lora_adapter", {"lora_name": served})
        if status != 200:
            raise LoadRefused(502, f"replica {inst.replica} of {model_name} did not unload {served}: "
                                   f"{status or 'unreachable'} {text}".strip(), code="upstream_error")
    _store(live, kept)
    return {"model_name": model_name, "adapter": served, "applied": "runtime", "replicas": [i.pk for i in live]}


LOADS_AT_START = "llama-server loads adapters at start"
COPIED_AT_START = "each node copies an adapter from the store when its replica starts"


def _restart_with(live: list[ModelInstance], adapters: list[dict], what: str, *, served: str,
                  why: str = LOADS_AT_START) -> dict:
    """A rolling restart that starts each replica with the new set (its plan checked first: one
    that cannot be made changes nothing); each replica's row takes the set when it restarts, so
    the proxy's per-request `lora` ids always match what that engine loaded."""
    order = request_rollout(model_name=live[0].model_name, adapters=adapters)
    for inst in order:
        inst.note(f"adapters changed ({what}): {why}, so the replicas restart one at a time with the new set")
    return {"model_name": live[0].model_name, "adapter": served, "applied": "rolling_restart",
            "replicas": [i.pk for i in order]}

