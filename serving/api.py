"""The management API: load, unload, restart, and read instances (mounted at /api/management)."""
from __future__ import annotations

import json

from django.http import HttpRequest
from ninja import Router, Status

from accounts.audit import record_audit
from accounts.auth import api_auth, operator_auth, require_role, visible_models
from accounts.errors import ApiError
from serving.models import ModelInstance
from serving.planning import LoadRefused, local_python, stored_plan
from serving.schemas import InstanceOut, InstanceRef, LoadIn, LoadOut
from serving.services import find_instance, request_load, request_restart, request_start, request_unload

management_router = Router()


def instance_out(inst: ModelInstance) -> dict:
    plan = stored_plan(inst)
    return {
        "id": inst.pk, "model_name": inst.model_name, "model_path": inst.model_path, "type": inst.type,
        "state": inst.state, "state_message": inst.state_message, "progress_pct": inst.progress_pct,
        "desired_state": inst.desired_state, "backend": inst.backend, "backend_reason": inst.backend_reason,
        "node": inst.node.name, "gpus": list(inst.gpus or []), "port": inst.port, "pid": inst.pid,
        "restarts": inst.restarts, "error": inst.last_error, "exit_code": inst.exit_code,
        "extra_args": inst.extra_args or {}, "ready_at": inst.ready_at, "created_at": inst.created_at,
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
        )
    except LoadRefused as exc:
        _audit_refused(request, "load", body.model_name or body.model_path, exc)
        raise _refused(exc) from None
    record_audit(action="load", target=_target(inst), request=request,
                 detail={"model_path": inst.model_path, "node": inst.node.name, "backend": inst.backend})
    return Status(202, {"id": inst.pk, "model_name": inst.model_name, "state": inst.state, "backend": inst.backend,
                 "backend_reason": inst.backend_reason, "node": inst.node.name, "gpus": list(inst.gpus),
                 "policy": inst.policy, "idle_ttl_s": inst.idle_ttl_s, "pinned": inst.pinned,
                 "max_concurrency": inst.max_concurrency, "autostart": inst.autostart,
                 "first_byte_timeout_s": inst.first_byte_timeout_s})


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
    return [instance_out(i) for i in qs[:500]]


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
