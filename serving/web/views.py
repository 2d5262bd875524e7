"""Instance pages: the list, the Load dialog (with its live verdict), one instance with its log,
timeline and playground, and the operator actions."""
from __future__ import annotations

import re

from asgiref.sync import async_to_sync
from django.contrib import messages
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from accounts.audit import record_audit
from accounts.auth import role_required
from accounts.models import Role
from accounts.query import ascii_int
from hardware.models import GpuDevice, Node
from hub import layout
from hub.models import ModelArtifact
from serving.control import presets, runtime_adapters
from serving.control.placement import gpu_rooms
from serving.control.planning import LoadRefused, backends_for, plan_load
from serving.control.replicas import request_scale
from serving.control.services import request_load, request_restart, request_unload
from serving.models import (
    EnginePreset,
    InstanceState,
    InstanceType,
    ModelDeployment,
    ModelInstance,
    ScalingDecision,
    name_holders,
)
from serving.node.logs import current_log, previous_log
from serving.proxy.metrics import usage_summary
from serving.proxy.ondemand import queue_depth
from serving.proxy.replicas import routing_table
from serving.web.forms import ExtraArgsError, LoadForm, parse_adapters, parse_extra_args
from serving.web.inference_api import ask_as_session
from serving.web.live import instances_context, timeline_events

ASCII_INT_RE = re.compile(r"^[0-9]{1,6}$")  # str.isdigit() also passes '²', which int() refuses


def _can_operate(request: HttpRequest) -> bool:
    return request.user.has_role(Role.OPERATOR)


@require_GET
def instances_page(request: HttpRequest) -> HttpResponse:
    raw = request.GET.get("page", "1")
    page = ascii_int(raw) or 1  # past the last page: the last one
    ctx = instances_context(can_operate=_can_operate(request), page=page)
    for inst in ctx["instances"]:  # this process's queue (max_concurrency); the page shows it on load
        inst.queue_depth = queue_depth(inst.model_name)
    if request.htmx:  # the websocket (re)connected: catch up on what happened before it
        return render(request, "serving/partials/_instances_card.html", {**ctx, "oob": True})
    return render(request, "serving/instances.html", ctx)


def _node_choices() -> list[Node]:
    return list(Node.objects.prefetch_related("gpus").order_by("name"))


def _gpu_choices(node_name: str | None) -> list[tuple[int, str]]:
    """(index, label with free memory) for the GPUs of a node."""
    node = Node.objects.filter(name=node_name).first() if node_name else Node.fresh().first()
    if node is None:
        return []
    rooms = {r.index: r for r in gpu_rooms(node)}
    out = []
    for g in GpuDevice.objects.filter(node=node).order_by("index"):
        room = rooms.get(g.index)
        free = room.free_mib if room else g.memory_free_mib
        out.append((g.index, f"GPU {g.index} · {g.name} · {free / 1024:.1f} of {g.memory_total_mib / 1024:.1f} GiB free"))
    return out


def _gpu_indexes(data) -> list[int]:
    return [int(g) for g in data.getlist("gpus") if ASCII_INT_RE.match(str(g))]


def _preset_choice(data) -> tuple[list, str]:
    """The Load dialog's preset select: (the model's presets, the one selected): the one the form
    names while the model has it, else the model's default, else none."""
    try:
        key = presets.normalize_model_path(data.get("model_path", ""))
    except presets.PresetInvalid:
        return [], presets.NO_PRESET
    rows = list(EnginePreset.objects.filter(model_path=key)[:100])
    wanted = data.get("preset") or ""
    if wanted == presets.NO_PRESET or any(p.name == wanted for p in rows):
        return rows, wanted
    return rows, next((p.name for p in rows if p.is_default), presets.NO_PRESET)


def _plan_kwargs(data) -> dict:
    """Arguments for plan_load from the form's raw data (the verdict runs on partial input)."""
    extra = parse_extra_args(data.get("extra_args", ""))
    tp_raw = (data.get("tensor_parallel_size") or "").strip()
    if tp_raw and not ASCII_INT_RE.match(tp_raw):
        raise LoadRefused(400, "tensor_parallel_size must be a whole number from 1 to 64")
    gpus = _gpu_indexes(data)
    rows, selected = _preset_choice(data)
    return {
        "model_path": data.get("model_path", ""), "model_name": data.get("model_name") or None,
        "server_type": data.get("server_type") or "llm", "backend": data.get("backend") or "auto",
        "node": data.get("node") or None, "gpus": gpus or None,
        "tensor_parallel_size": int(tp_raw) if tp_raw else None, "extra_args": extra,
        "adapters": parse_adapters(data.get("adapters", "")),
        "preset": next((presets.snapshot(p) for p in rows if p.name == selected), None),
    }


@role_required(Role.OPERATOR)
@require_GET
def load_verdict(request: HttpRequest) -> HttpResponse:
    """The Load dialog's verdict: backend and why, where it fits, and the command line (the same
    plan a load would store)."""
    ctx: dict = {}
    try:
        plan = plan_load(**_plan_kwargs(request.GET))
        ctx["plan"] = plan
        ctx["command"] = plan.command_line
        ctx["backends"] = backends_for(plan)
    except ExtraArgsError as exc:
        ctx["error"] = f"Extra arguments: {exc}"
    except LoadRefused as exc:
        ctx["error"] = exc.message
    except ValueError as exc:  # parse_adapters
        ctx["error"] = f"LoRA adapters: {exc}"
    ctx["gpu_choices"] = _gpu_choices(request.GET.get("node"))
    ctx["selected_gpus"] = set(_gpu_indexes(request.GET))
    ctx["preset_rows"], ctx["preset_selected"] = _preset_choice(request.GET)
    return render(request, "serving/partials/_load_verdict.html", ctx)


@role_required(Role.OPERATOR)
@require_http_methods(["GET", "POST"])
def load_page(request: HttpRequest) -> HttpResponse:
    nodes = _node_choices()
    node_name = request.POST.get("node") or request.GET.get("node") or (nodes[0].name if nodes else None)
    gpu_choices = _gpu_choices(node_name)
    error = None
    if request.method == "POST":
        form = LoadForm(request.POST, gpu_choices=gpu_choices)
        if form.is_valid():
            d = form.cleaned_data
            try:
                inst = request_load(
                    model_path=d["model_path"], model_name=d["model_name"] or None, server_type=d["server_type"],
                    backend=d["backend"], node=d["node"] or None, gpus=d["gpus"] or None,
                    tensor_parallel_size=d["tensor_parallel_size"], extra_args=d["extra_args"],
                    autostart=d["autostart"], user=request.user, fallback=d["fallback"] or None, policy=d["policy"],
                    idle_ttl_s=d["idle_ttl_s"], pinned=d["pinned"], max_concurrency=d["max_concurrency"],
                    adapters=d["adapters"], preset=d["preset"] or None,
                )
            except LoadRefused as exc:
                error = exc.message
                record_audit(action="load", target=d["model_name"] or d["model_path"], request=request,
                             outcome="refused", detail={"code": exc.code, "message": exc.message[:300]})
            else:
                record_audit(action="load", target=f"{inst.model_name} (instance {inst.pk})", request=request,
                             detail={"model_path": inst.model_path, "node": inst.node.name, "backend": inst.backend})
                messages.success(request, f"Loading {inst.model_name} on {inst.node.name}." if inst.state != "IDLE"
                                 else f"{inst.model_name} is registered on {inst.node.name}; the first request "
                                      "starts it.")
                return redirect("instance-detail", pk=inst.pk)
    else:
        form = LoadForm(initial={"model_path": request.GET.get("model_path", ""), "node": node_name},
                        gpu_choices=gpu_choices)
    preset_rows, preset_selected = _preset_choice(request.POST if request.method == "POST" else request.GET)
    ctx = {"form": form, "nodes": nodes, "node_name": node_name, "error": error,
           "preset_rows": preset_rows, "preset_selected": preset_selected,
           "can_operate": _can_operate(request), "store_adapters": _store_adapters(),
           "artifacts": _store_models()}
    status = 400 if error or (request.method == "POST" and not form.is_valid()) else 200
    return render(request, "serving/load.html", ctx, status=status)


def _store_models() -> list[str]:
    """The store's complete models, for the Load page's and the presets page's pick list (an
    adapter under lora/ loads with its base, never alone)."""
    return list(ModelArtifact.objects.filter(complete=True).exclude(format=layout.LORA)
                .values_list("prefix", flat=True)[:500])


def _store_adapters() -> list[dict]:
    """The store's complete LoRA adapters for the Load page: prefix, the line to add, the engine."""
    rows = []
    for prefix, files in ModelArtifact.objects.filter(complete=True, format=layout.LORA).values_list(
            "prefix", "files")[:200]:
        kind = layout.lora_base_format(str(f.get("path", "")) for f in files or [] if isinstance(f, dict))
        name = re.sub(r"[^a-z0-9._-]", "-", prefix.split("/", 1)[1].lower()).strip("-._")[:64] or "adapter"
        rows.append({"prefix": prefix, "line": f"{name} {prefix} 1.0",
                     "kind": {layout.GGUF: "GGUF, for llama-server", layout.HUGGINGFACE: "PEFT, for vLLM"}.get(
                         kind or "", "unreadable")})
    return rows


@require_GET
def instance_detail(request: HttpRequest, pk: int) -> HttpResponse:
    inst = get_object_or_404(ModelInstance.objects.select_related("node"), pk=pk)
    log_path = current_log(inst.pk)
    offset, lines = _last_lines(log_path, 500) if log_path.exists() else (0, list(inst.log_tail or []))
    evs = timeline_events(inst.pk)
    base = request.build_absolute_uri("/v1")
    ctx = {
        "inst": inst, "events": evs, "version": evs[-1].pk if evs else 0, "log_lines": lines, "log_offset": offset,
        "can_operate": _can_operate(request),
        "has_previous": previous_log(inst.pk).exists(), "api_base": base,
        "usage": usage_summary(instance_id=inst.pk),
    }
    # Replicas (issue 30): every holder of the served name, the desired count, usage per replica and summed.
    replicas = list(ModelInstance.objects.select_related("node").filter(name_holders(), model_name=inst.model_name)
                    .order_by("replica", "pk"))
    deployment = ModelDeployment.objects.filter(model_name=inst.model_name).first()
    ctx["runtime_adapters"] = inst.backend == "vllm"
    if inst.type == InstanceType.LLM and not request.htmx:
        ctx["store_adapters"] = _store_adapters()
    ctx.update(replicas=replicas, replicas_desired=deployment.replicas if deployment else len(replicas),
               deployment=deployment,
               decisions=list(ScalingDecision.objects.filter(model_name=inst.model_name)[:20]))
    if len(replicas) > 1:
        rows = usage_summary(model=inst.model_name)
        ctx["usage"] = rows
        ctx["usage_total"] = {k: sum(r[k] for r in rows) for k in
                              ("requests", "errors", "in_flight", "prompt_tokens", "completion_tokens")}
    if request.htmx:  # the websocket (re)connected: catch up on what happened before it
        return render(request, "serving/partials/_instance_live.html", ctx)
    return render(request, "serving/instance_detail.html", ctx)


def _last_lines(path, n: int) -> tuple[int, list[str]]:
    """(offset after the last complete line, the last n complete lines) of a log file."""
    with open(path, "rb") as fh:
        fh.seek(0, 2)
        size = fh.tell()
        start = max(0, size - 256 * 1024)
        fh.seek(start)
        data = fh.read()
    complete = data[: data.rfind(b"\n") + 1]
    return start + len(complete), complete.decode(errors="replace").splitlines()[-n:]


@require_GET
def instance_log(request: HttpRequest, pk: int) -> FileResponse:
    inst = get_object_or_404(ModelInstance, pk=pk)
    which = request.GET.get("run", "current")
    if which not in ("current", "previous"):
        raise Http404("run is current or previous")
    path = current_log(inst.pk) if which == "current" else previous_log(inst.pk)
    if not path.exists():
        raise Http404("no log for this run")
    name = f"{inst.model_name.replace('/', '_')}-{inst.pk}-{which}.log"
    return FileResponse(open(path, "rb"), as_attachment=True, filename=name, content_type="text/plain")  # noqa: SIM115


@role_required(Role.OPERATOR)
@require_POST
def instance_unload(request: HttpRequest, pk: int) -> HttpResponse:
    return _instance_action(request, pk, "unload")


@role_required(Role.OPERATOR)
@require_POST
def instance_restart(request: HttpRequest, pk: int) -> HttpResponse:
    return _instance_action(request, pk, "restart")


@role_required(Role.OPERATOR)
@require_POST
def instance_scale(request: HttpRequest, pk: int) -> HttpResponse:
    """The scale control (issue 30): the instance's served name to `replicas` replicas."""
    inst = get_object_or_404(ModelInstance.objects.select_related("node"), pk=pk)
    raw = request.POST.get("replicas", "")
    replicas = int(raw) if ASCII_INT_RE.match(raw) else 0
    target = inst.model_name
    try:
        done = request_scale(model_name=target, replicas=replicas, user=request.user,
                             in_flight=routing_table.in_flight_by_instance())
    except LoadRefused as exc:
        text, kind = exc.message, "error"
        record_audit(action="scale", target=target, request=request, outcome="refused",
                     detail={"code": exc.code, "message": exc.message[:300]})
    else:
        text, kind = f"{target}: {done.previous} -> {done.replicas} replicas requested", "success"
        if done.draining:
            text += f" ({len(done.draining)} draining: out of routing, stopped once their requests are done)"
        record_audit(action="scale", target=target, request=request,
                     detail={"from": done.previous, "to": done.replicas, "started": [i.pk for i in done.started],
                             "draining": [i.pk for i in done.draining]})
    if request.htmx:
        return render(request, "serving/partials/_action_msg.html", {"text": text, "kind": kind})
    getattr(messages, kind)(request, text)
    return redirect("instance-detail", pk=pk)


@role_required(Role.OPERATOR)
@require_POST
def instance_adapters(request: HttpRequest, pk: int) -> HttpResponse:
    """The LoRA adapters card (issue 27 #1): add one (name, path, scale) or remove one, on the
    instance's model (every replica): at runtime on vLLM, by a rolling restart on llama-server."""
    inst = get_object_or_404(ModelInstance.objects.select_related("node"), pk=pk)
    target = inst.model_name
    name = (request.POST.get("name") or "").strip()[:64]
    removing = request.POST.get("action") == "remove"
    action = "adapter_remove" if removing else "adapter_add"
    try:
        if removing:
            done = runtime_adapters.remove_adapter(model_name=target, name=name)
        else:
            raw_scale = (request.POST.get("scale") or "").strip() or "1"
            try:
                scale = float(raw_scale)
            except ValueError:
                raise LoadRefused(400, f"the scale {raw_scale[:20]!r} is not a number") from None
            done = runtime_adapters.add_adapter(model_name=target, adapter={
                "name": name, "path": (request.POST.get("path") or "").strip()[:1024], "scale": scale})
    except LoadRefused as exc:
        text, kind = exc.message, "error"
        record_audit(action=action, target=f"{target}:{name}", request=request, outcome="refused",
                     detail={"code": exc.code, "message": exc.message[:300]})
    else:
        kind = "success"
        text = (f"{done['adapter']} {'removed' if removing else 'added'} at runtime on "
                f"{len(done['replicas'])} replica(s)" if done["applied"] == "runtime" else
                f"{done['adapter']}: the replicas restart one at a time with the new set (llama-server loads "
                "adapters at start)")
        record_audit(action=action, target=done["adapter"], request=request,
                     detail={"applied": done["applied"], "replicas": done["replicas"]})
    if request.htmx:
        return render(request, "serving/partials/_action_msg.html", {"text": text, "kind": kind})
    getattr(messages, kind)(request, text)
    return redirect("instance-detail", pk=pk)


def _instance_action(request: HttpRequest, pk: int, action: str) -> HttpResponse:
    inst = get_object_or_404(ModelInstance.objects.select_related("node"), pk=pk)
    try:
        if action == "unload":
            request_unload(instance=inst)
            text, kind = f"Unload of {inst.model_name} requested.", "success"
        elif action == "restart":
            request_restart(instance=inst)
            text, kind = f"Restart of {inst.model_name} requested.", "success"
        else:
            raise Http404("unknown action")
    except LoadRefused as exc:
        text, kind = exc.message, "error"
        record_audit(action=action, target=f"{inst.model_name} (instance {inst.pk})", request=request,
                     outcome="refused", detail={"code": exc.code, "message": exc.message[:300]})
    else:
        record_audit(action=action, target=f"{inst.model_name} (instance {inst.pk})", request=request,
                     detail={"node": inst.node.name})
    if request.htmx:
        return render(request, "serving/partials/_action_msg.html", {"text": text, "kind": kind})
    getattr(messages, kind)(request, text)
    return redirect("instance-detail", pk=pk)


@require_POST
def playground(request: HttpRequest, pk: int) -> HttpResponse:
    """Send one chat message (LLM), one text to embed, or a query and its documents (a reranker:
    the first line and the lines after it) to the instance's model, server-side. It goes through
    the inference proxy as the signed-in user (serving.web.inference_api.ask_as_session), never straight
    to the backend: the queue, max_concurrency, usage and the request log hold for it as for /v1/."""
    inst = get_object_or_404(ModelInstance.objects.select_related("node"), pk=pk)
    text = (request.POST.get("prompt") or "").strip()
    ctx: dict = {"inst": inst, "prompt": text}
    if not text or len(text) > 8000:
        ctx["error"] = "Type a message (at most 8000 characters)."
    elif inst.state != InstanceState.READY:
        ctx["error"] = f"{inst.model_name} is {inst.state}, not READY."
    elif inst.type == "rerank" and len([line for line in text.splitlines() if line.strip()]) < 2:
        ctx["error"] = "Give the query on the first line and at least one document on the lines after it."
    else:
        if inst.type == "rerank":
            query, *docs = [line.strip() for line in text.splitlines() if line.strip()]
            path, body = "/v1/rerank", {"model": inst.model_name, "query": query, "documents": docs}
        elif inst.type == "embedding":
            path, body = "/v1/embeddings", {"model": inst.model_name, "input": text}
        else:
            path, body = "/v1/chat/completions", {"model": inst.model_name, "max_tokens": 64,
                                                  "messages": [{"role": "user", "content": text}]}
        status, data = async_to_sync(ask_as_session)(request, path, body)
        try:
            if status != 200:
                error = data.get("error")
                message = error.get("message") if isinstance(error, dict) else None
                ctx["error"] = f"{status}: {str(message or data)[:300]}"
            elif inst.type == "rerank":
                ctx["prompt"] = query
                ctx["ranking"] = [{"score": row["relevance_score"], "document": docs[row["index"]]}
                                  for row in data["results"]]
            elif inst.type == "embedding":
                vec = data["data"][0]["embedding"]
                ctx["embedding"] = {"dims": len(vec), "head": ", ".join(f"{v:.4f}" for v in vec[:8])}
            else:
                ctx["reply"] = data["choices"][0]["message"]["content"]
                ctx["usage"] = data.get("usage") or {}
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            ctx["error"] = f"The backend's answer was not understood: {exc.__class__.__name__}: {str(exc)[:200]}"
    return render(request, "serving/partials/_playground_reply.html", ctx)


SETTING_INPUTS = (  # the presets page's inputs: (setting, label, input type)
    ("context_size", "Context size (tokens)", "number"), ("parallel", "Parallel requests (slots / max sequences)",
                                                          "number"),
    ("kv_cache_type", "KV cache type", "choice"), ("flash_attention", "Flash attention", "onoff"),
    ("tool_call_parser", "Tool-call parser (vLLM name; llama-server: auto)", "text"),
    ("reasoning_parser", "Reasoning parser (vLLM name; llama-server none|deepseek|auto)", "text"),
    ("chat_template", "Chat template (inline Jinja or a built-in name)", "textarea"),
    ("speculative", "Speculative decoding, vLLM (JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4})",
     "json"),
)


def _settings_from_form(data) -> dict:
    """The presets page's inputs as a preset's settings (checked by presets.clean_settings)."""
    import json

    out: dict = {}
    for field, _, kind in SETTING_INPUTS:
        raw = (data.get(field) or "").strip()
        if not raw:
            continue
        if kind == "onoff":
            out[field] = raw == "on"
        elif kind == "json":
            try:
                out[field] = json.loads(raw)
            except ValueError:
                raise presets.PresetInvalid(f"{field} is a JSON object") from None
        elif kind == "number":
            out[field] = int(raw) if ASCII_INT_RE.match(raw) else raw
        else:
            out[field] = raw
    return out


@role_required(Role.OPERATOR)
@require_http_methods(["GET", "POST"])
def presets_page(request: HttpRequest) -> HttpResponse:
    """Engine presets (issue 27 #3): every model's, each held against the engine versions the
    nodes report; operators add, replace and delete them (each an audited action)."""
    error = None
    status = 200
    if request.method == "POST":
        action = request.POST.get("action", "save")
        target = f"{request.POST.get('model_path', '')[:200]}: {request.POST.get('name', '')[:64]}"
        try:
            if action == "delete":
                if not presets.delete(model_path=request.POST.get("model_path"), name=request.POST.get("name")):
                    raise presets.PresetInvalid(f"there is no preset {target}")
                record_audit(action="preset_delete", target=target, request=request)
                messages.success(request, f"Deleted the preset {target}.")
            else:
                row, created, _ = presets.save(
                    model_path=request.POST.get("model_path"), name=request.POST.get("name", "").strip(),
                    settings=_settings_from_form(request.POST), default=request.POST.get("default") == "on",
                    user=request.user)
                record_audit(action="preset", target=f"{row.model_path}: {row.name}", request=request,
                             detail={"settings": row.engine_settings, "default": row.is_default, "created": created})
                messages.success(request, f"{'Saved' if created else 'Replaced'} the preset {row.name} of "
                                          f"{row.model_path}.")
            return redirect("presets")
        except presets.PresetInvalid as exc:
            error, status = str(exc), 400
            record_audit(action="preset" if action != "delete" else "preset_delete", target=target, request=request,
                         outcome="refused", detail={"message": error[:300]})
    ctx = {"presets": presets.listing(), "error": error, "inputs": SETTING_INPUTS, "form": request.POST,
           "kv_types": presets.KV_CACHE_TYPES,
           "artifacts": _store_models()}
    return render(request, "serving/presets.html", ctx, status=status)
