"""The management API: load, scale, unload, restart, and read instances (mounted at /api/management)."""
from __future__ import annotations

import json

from django.http import HttpRequest
from ninja import Router, Status

from accounts.audit import record_audit
from accounts.auth import api_auth, operator_auth, require_role, visible_models
from accounts.errors import ApiError
from serving.control import presets, runtime_adapters
from serving.control.planning import LoadRefused, local_python, stored_plan
from serving.control.replicas import request_scale
from serving.control.rollout import request_rollout
from serving.control.services import (
    find_instance,
    request_load,
    request_restart,
    request_start,
    request_unload,
)
from serving.models import ModelDeployment, ModelInstance, ScalingDecision, name_holders
from serving.proxy.replicas import routing_table
from serving.web.schemas import (
    AdapterAddIn,
    AdapterChangeOut,
    AutoscaleIn,
    AutoscaleOut,
    InstanceOut,
    InstanceRef,
    LoadIn,
    LoadOut,
    PresetIn,
    PresetOut,
    RolloutIn,
    RolloutOut,
    ScaleIn,
    ScaleOut,
)

management_router = Router()


def _desired(names) -> dict[str, int]:
    return dict(ModelDeployment.objects.filter(model_name__in=set(names)).values_list("model_name", "replicas"))


def replica_out(inst: ModelInstance) -> dict:
    return {"id": inst.pk, "replica": inst.replica, "node": inst.node.name, "gpus": list(inst.gpus or []),
            "state": inst.state, "port": inst.port}


def instance_out(inst: ModelInstance, desired: dict[str, int] | None = None) -> dict:
    plan = stored_plan(inst)
    desired = _desired([inst.model_name]) if desired is None else desired
    return {
        "replica": inst.replica, "replicas_desired": desired.get(inst.model_name), "drain_until": inst.drain_until,
        "id": inst.pk, "model_name": inst.model_name, "model_path": inst.model_path, "type": inst.type,
        "adapters": list(inst.adapters or []),
        "state": inst.state, "state_message": inst.state_message, "progress_pct": inst.progress_pct,
        "desired_state": inst.desired_state, "backend": inst.backend, "backend_reason": inst.backend_reason,
        "node": inst.node.name, "gpus": list(inst.gpus or []), "port": inst.port, "pid": inst.pid,
        "restarts": inst.restarts, "error": inst.last_error, "exit_code": inst.exit_code,
        "extra_args": inst.extra_args or {}, "preset": inst.preset, "ready_at": inst.ready_at, "created_at": inst.created_at,
        "log_tail": list(inst.log_tail or []),
        "memory": {"estimate_mib": inst.estimated_memory_mib, "measured_mib": inst.measured_memory_mib,
                   "measured_source": inst.measured_source or None},
        "policy": inst.policy, "idle_ttl_s": inst.idle_ttl_s, "pinned": inst.pinned,
        "max_concurrency": inst.max_concurrency, "autostart": inst.autostart,
        "first_byte_timeout_s": inst.first_byte_timeout_s,
        "last_request_at": inst.last_request_at, "idle_unload_at": inst.idle_unload_at,
        # The argv as planned; {port}, {model} and {python} stay where only the node knows them.
        "command": plan.command(port=inst.port, model=plan.known_model_file,
                                python=local_python(inst.node.name)) if plan else None,
    }


def _refused(exc: LoadRefused) -> ApiError:
    detail = getattr(exc, "detail", None)  # does_not_fit: the numbers (needed, free, held by whom)
    message = exc.message if detail is None else f"{exc.message} {json.dumps(detail)}"
    error = ApiError(exc.status, message, code=exc.code)
    error.retry_after = exc.retry_after  # node_starting: when to ask again
    return error


def _ref(request: HttpRequest, body: InstanceRef, action: str) -> ModelInstance:
    if body.id is None and not body.model_name:
        raise ApiError(400, "Give the instance's id or its model_name.", code="invalid_request")
    try:
        return find_instance(id=body.id, model_name=body.model_name)
    except LoadRefused as exc:
        _audit_refused(request, action, body.model_name or f"instance {body.id}", exc)
        raise _refused(exc) from None


def _target(inst: ModelInstance) -> str:
    return f"{inst.model_name} (instance {inst.pk})"


def _audit_refused(request: HttpRequest, action: str, target: str, exc: LoadRefused) -> None:
    record_audit(action=action, target=target, request=request, outcome="refused",
                 detail={"code": exc.code, "message": exc.message[:300]})


@management_router.post("/load", response={202: LoadOut}, auth=operator_auth, summary="Load a model on a node")
def load(request: HttpRequest, body: LoadIn):
    user = require_role(request, "operator")
    try:
        inst = request_load(
            model_path=body.model_path, model_name=body.model_name, server_type=body.server_type,
            backend=body.backend, node=body.node, gpus=body.gpus, tensor_parallel_size=body.tensor_parallel_size,
            extra_args=body.extra_args, autostart=body.autostart, user=user, aliases=body.aliases,
            fallback=body.fallback,
            policy=body.policy, idle_ttl_s=body.idle_ttl_s, pinned=body.pinned, max_concurrency=body.max_concurrency,
            start=body.start, first_byte_timeout_s=body.first_byte_timeout_s,
            replicas=body.replicas, partial=body.partial, drain_timeout_s=body.drain_timeout_s,
            adapters=[a.dict() for a in body.adapters or []], preset=body.preset,
        )
    except LoadRefused as exc:
        _audit_refused(request, "load", body.model_name or body.model_path, exc)
        raise _refused(exc) from None
    placed = getattr(inst, "placed", [inst])
    detail = {"model_path": inst.model_path, "node": inst.node.name, "backend": inst.backend}
    if inst.preset:
        detail["preset"] = inst.preset["name"]
    if body.replicas > 1:
        detail.update(replicas=len(placed), wanted=body.replicas,
                      where=[f"{i.node.name}:{','.join(map(str, i.gpus)) or 'cpu'}" for i in placed])
    record_audit(action="load", target=_target(inst), request=request, detail=detail)
    return Status(202, {
                 "replica": inst.replica, "replicas": [replica_out(i) for i in placed],
                 "replicas_wanted": body.replicas, "partial": len(placed) < body.replicas,
                 "refused": list(getattr(inst, "refusals", [])),"id": inst.pk, "model_name": inst.model_name, "state": inst.state, "backend": inst.backend,
                 "backend_reason": inst.backend_reason, "node": inst.node.name, "gpus": list(inst.gpus),
                 "policy": inst.policy, "idle_ttl_s": inst.idle_ttl_s, "pinned": inst.pinned,
                 "max_concurrency": inst.max_concurrency, "autostart": inst.autostart,
                 "first_byte_timeout_s": inst.first_byte_timeout_s})


@management_router.post("/scale", response={202: ScaleOut}, auth=operator_auth,
                        summary="Change a model's replica count")
def scale(request: HttpRequest, body: ScaleIn):
    """Up: the new replicas planned and placed as loads (409 does_not_fit with the numbers, or
    `partial`). Down: the replicas with the fewest requests in flight leave routing at once and
    stop once drained (`drain_timeout_s`)."""
    user = require_role(request, "operator")
    models = visible_models(request)
    try:
        if models is not None and body.model_name not in models:
            raise LoadRefused(404, f"no model {body.model_name[:120]!r} is loaded", code="model_not_found")
        done = request_scale(model_name=body.model_name, replicas=body.replicas, partial=body.partial,
                             drain_timeout_s=body.drain_timeout_s, user=user,
                             in_flight=routing_table.in_flight_by_instance())
    except LoadRefused as exc:
        _audit_refused(request, "scale", body.model_name, exc)
        raise _refused(exc) from None
    record_audit(action="scale", target=body.model_name, request=request,
                 detail={"from": done.previous, "to": done.replicas, "wanted": done.wanted,
                         "started": [i.pk for i in done.started], "draining": [i.pk for i in done.draining]})
    holders = ModelInstance.objects.select_related("node").filter(name_holders(), model_name=body.model_name)
    return Status(202, {
        "model_name": done.model_name, "previous": done.previous, "replicas": done.replicas, "wanted": done.wanted,
        "partial": done.partial, "started": [i.pk for i in done.started], "draining": [i.pk for i in done.draining],
        "refused": done.refusals, "instances": [replica_out(i) for i in holders.order_by("replica", "pk")]})


@management_router.post("/autoscale", response={200: AutoscaleOut}, auth=operator_auth,
                        summary="Set a model's autoscaling (min, max, target in flight, windows)")
def autoscale(request: HttpRequest, body: AutoscaleIn):
    """The autoscaler (serving.control.autoscale) keeps the model's replica count between min and
    max, at `target_in_flight` per replica; null turns it off (the count stays as it is)."""
    require_role(request, "operator")
    models = visible_models(request)
    deployment = ModelDeployment.objects.filter(model_name=body.model_name).first()
    error = None
    if deployment is None or (models is not None and body.model_name not in models):
        error = ApiError(404, f"No model {body.model_name[:120]!r} was ever loaded.", code="model_not_found")
    elif body.min_replicas > body.max_replicas:
        error = ApiError(400, "min_replicas must be <= max_replicas.", code="invalid_request")
    if error is not None:
        record_audit(action="autoscale_settings", target=body.model_name, request=request, outcome="refused",
                     detail={"code": error.code})
        raise error
    fields = body.dict(exclude={"model_name"})
    ModelDeployment.objects.filter(pk=deployment.pk).update(**fields)
    deployment.refresh_from_db()
    record_audit(action="autoscale_settings", target=body.model_name, request=request, detail=fields)
    return autoscale_out(deployment)


def autoscale_out(deployment: ModelDeployment) -> dict:
    decisions = ScalingDecision.objects.filter(model_name=deployment.model_name)[:50]
    return {"model_name": deployment.model_name, "replicas": deployment.replicas,
            "min_replicas": deployment.min_replicas, "max_replicas": deployment.max_replicas,
            "target_in_flight": deployment.target_in_flight, "scale_up_window_s": deployment.scale_up_window_s,
            "scale_down_delay_s": deployment.scale_down_delay_s, "enabled": deployment.autoscaling,
            "decisions": [{"at": d.at, "model_name": d.model_name, "from_replicas": d.from_replicas,
                           "to_replicas": d.to_replicas, "reason": d.reason} for d in decisions]}


@management_router.post("/rollout", response={202: RolloutOut}, auth=operator_auth,
                        summary="Restart a model's replicas one at a time with new engine settings")
def rollout(request: HttpRequest, body: RolloutIn):
    """A rolling restart: each replica leaves routing, finishes its requests, restarts with the new
    extra_args (and the backend version its node has now) and is READY before the next goes."""
    require_role(request, "operator")
    models = visible_models(request)
    try:
        if models is not None and body.model_name not in models:
            raise LoadRefused(404, f"no model {body.model_name[:120]!r} is loaded", code="model_not_found")
        order = request_rollout(model_name=body.model_name, extra_args=body.extra_args,
                                drain_timeout_s=body.drain_timeout_s)
    except LoadRefused as exc:
        _audit_refused(request, "rollout", body.model_name, exc)
        raise _refused(exc) from None
    record_audit(action="rollout", target=body.model_name, request=request,
                 detail={"order": [i.pk for i in order], "extra_args": body.extra_args})
    return Status(202, {"model_name": body.model_name, "order": [i.pk for i in order], "extra_args": body.extra_args})


@management_router.post("/adapters", response={200: AdapterChangeOut, 202: AdapterChangeOut}, auth=operator_auth,
                        summary="Add a LoRA adapter to a loaded model")
def adapter_add(request: HttpRequest, body: AdapterAddIn):
    """vLLM: loaded into every READY replica at runtime (200, `applied: runtime`; 409 when the
    version cannot or the model was started without --enable-lora). llama-server loads adapters at
    start: its replicas restart one at a time with the new set (202, `applied: rolling_restart`)."""
    require_role(request, "operator")
    models = visible_models(request)
    try:
        if models is not None and body.model_name not in models:
            raise LoadRefused(404, f"no model {body.model_name[:120]!r} is loaded", code="model_not_found")
        done = runtime_adapters.add_adapter(model_name=body.model_name, adapter={
            "name": body.name, "path": body.path, "scale": 1.0 if body.scale is None else body.scale})
    except LoadRefused as exc:
        _audit_refused(request, "adapter_add", f"{body.model_name}:{body.name}", exc)
        raise _refused(exc) from None
    record_audit(action="adapter_add", target=done["adapter"], request=request,
                 detail={"path": body.path, "applied": done["applied"], "replicas": done["replicas"]})
    return Status(200 if done["applied"] == "runtime" else 202, done)


@management_router.delete("/adapters", response={200: AdapterChangeOut, 202: AdapterChangeOut}, auth=operator_auth,
                          summary="Remove a LoRA adapter from a loaded model")
def adapter_remove(request: HttpRequest, model_name: str, name: str):
    """As adding: at runtime on vLLM (200), a rolling restart on llama-server (202)."""
    require_role(request, "operator")
    models = visible_models(request)
    try:
        if models is not None and model_name not in models:
            raise LoadRefused(404, f"no model {model_name[:120]!r} is loaded", code="model_not_found")
        done = runtime_adapters.remove_adapter(model_name=model_name, name=name)
    except LoadRefused as exc:
        _audit_refused(request, "adapter_remove", f"{model_name}:{name}"[:300], exc)
        raise _refused(exc) from None
    record_audit(action="adapter_remove", target=done["adapter"], request=request,
                 detail={"applied": done["applied"], "replicas": done["replicas"]})
    return Status(200 if done["applied"] == "runtime" else 202, done)


@management_router.get("/presets", response=list[PresetOut], auth=operator_auth,
                       summary="A model's engine presets (or every model's)")
def preset_list(request: HttpRequest, model_path: str | None = None):
    """Each with `engines`: the preset held against every engine version the nodes report for
    the model's format, as they stand now (ok, or why not)."""
    require_role(request, "operator")
    try:
        return presets.listing(model_path)
    except presets.PresetInvalid as exc:
        raise ApiError(400, str(exc), code="invalid_preset") from None


@management_router.put("/presets", response={200: PresetOut, 201: PresetOut}, auth=operator_auth,
                       summary="Create or replace a model's engine preset")
def preset_save(request: HttpRequest, body: PresetIn):
    """400 invalid_preset naming the field, or, when no engine version a node has can apply it,
    each engine's reason (the engine's flags at that version, as extra_args are checked)."""
    user = require_role(request, "operator")
    try:
        row, created, checks = presets.save(model_path=body.model_path, name=body.name, settings=body.settings,
                                            default=body.default, user=user)
    except presets.PresetInvalid as exc:
        record_audit(action="preset", target=f"{body.model_path[:200]}: {body.name}", request=request,
                     outcome="refused", detail={"message": str(exc)[:300]})
        raise ApiError(400, str(exc), code="invalid_preset") from None
    record_audit(action="preset", target=f"{row.model_path}: {row.name}", request=request,
                 detail={"settings": row.engine_settings, "default": row.is_default, "created": created})
    return Status(201 if created else 200, presets.out(row, checks))


@management_router.delete("/presets", response={204: None}, auth=operator_auth,
                          summary="Delete a model's engine preset")
def preset_delete(request: HttpRequest, model_path: str, name: str):
    """Instances loaded with it keep the settings they were loaded with."""
    require_role(request, "operator")
    try:
        found = presets.delete(model_path=model_path, name=name)
    except presets.PresetInvalid as exc:
        raise ApiError(400, str(exc), code="invalid_preset") from None
    if not found:
        raise ApiError(404, f"{model_path[:200]} has no preset {name[:64]!r}.", code="preset_not_found")
    record_audit(action="preset_delete", target=f"{model_path}: {name}", request=request)
    return Status(204, None)


@management_router.post("/unload", response={202: InstanceOut}, auth=operator_auth, summary="Unload an instance")
def unload(request: HttpRequest, body: InstanceRef):
    require_role(request, "operator")
    inst = request_unload(instance=_ref(request, body, "unload"))
    record_audit(action="unload", target=_target(inst), request=request, detail={"node": inst.node.name})
    return Status(202, instance_out(inst))


@management_router.post("/restart", response={202: InstanceOut}, auth=operator_auth, summary="Restart an instance")
def restart(request: HttpRequest, body: InstanceRef):
    return _act(request, body, "restart", request_restart)


def _act(request: HttpRequest, body: InstanceRef, action: str, do) -> Status:
    """An operator's action on one instance (restart, start): refused ones audited, 202 with the instance."""
    require_role(request, "operator")
    target = _ref(request, body, action)
    try:
        inst = do(instance=target)
    except LoadRefused as exc:
        _audit_refused(request, action, _target(target), exc)
        raise _refused(exc) from None
    record_audit(action=action, target=_target(inst), request=request, detail={"node": inst.node.name})
    return Status(202, instance_out(inst))


@management_router.post("/start", response={202: InstanceOut}, auth=operator_auth,
                        summary="Start an IDLE on_demand instance now")
def start(request: HttpRequest, body: InstanceRef):
    return _act(request, body, "start", request_start)


@management_router.get("/instances", response=list[InstanceOut], auth=api_auth, summary="List instances")
def instances(request: HttpRequest, state: str | None = None):
    qs = ModelInstance.objects.select_related("node")
    models = visible_models(request)
    if models is not None:  # a key's allowed_models: its models' instances only
        qs = qs.filter(model_name__in=sorted(models))
    if state:
        qs = qs.filter(state=state.upper())
    rows = list(qs[:500])
    desired = _desired(i.model_name for i in rows)
    return [instance_out(i, desired) for i in rows]


@management_router.get("/instances/{instance_id}", response=InstanceOut, auth=api_auth, summary="One instance")
def instance(request: HttpRequest, instance_id: int):
    try:
        found = find_instance(id=instance_id)
    except LoadRefused as exc:
        raise _refused(exc) from None
    models = visible_models(request)
    if models is not None and found.model_name not in models:
        raise ApiError(404, f"No instance {instance_id}.", code="instance_not_found")
    return instance_out(found)
