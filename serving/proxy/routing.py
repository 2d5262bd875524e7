"""Routing: which route a proxy path is, the model list, and which READY replicas a request may
go to (its `model`, an alias, or the path's kind), with the type rules. No request waits for the
database here: everything is read from the routing table's in-memory snapshot (replicas.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from accounts.credentials import Principal
from serving.adapters import ADAPTERS
from serving.proxy import ondemand
from serving.proxy.bodies import form_model_span
from serving.proxy.errors import ProxyError
from serving.proxy.replicas import Backend, Standby, routing_table

INFERENCE_PREFIX = "/api/inference"

# Paths whose kind of model is fixed (after the /api/inference and /embedding prefixes are taken
# off): a named model of another type is refused, and without a `model` the kind picks one.
PATH_KINDS = {
    "/v1/chat/completions": "llm",
    "/v1/completions": "llm",
    "/v1/responses": "llm",
    "/v1/messages": "llm",
    "/v1/messages/count_tokens": "llm",
    "/v1/embeddings": "embedding",
    "/v1/rerank": "rerank",
    "/v1/reranking": "rerank",  # llama-server's alias of /v1/rerank
    "/v1/score": "rerank",
    "/rerank": "rerank",
    "/score": "rerank",
    "/infill": "llm",
    "/apply-template": "llm",
}
# The engines' own routes outside /v1/ that take a model, reachable as /api/inference/<route>.
ENGINE_ROUTES = frozenset({"tokenize", "detokenize", "apply-template", "infill", "rerank", "score", "pooling",
                           "classify"})
# A POST /v1/<path> is forwarded when some engine serves it as an inference route (the engines'
# allowlists, serving/adapters); each request then only to an engine that serves it.
FORWARDED_V1_ROUTES = frozenset(p for adapter in ADAPTERS.values() for p in adapter.inference_routes
                                if p.startswith("/v1/"))


@dataclass(frozen=True)
class Route:
    """What a proxy path asks for: the method, `models` / `model` / `forward`, the kind of model
    (None: any), whether it came by the explicit embedding prefix, and the backend's path."""

    method: str
    operation: str
    kind: str | None
    embedding_only: bool
    upstream_path: str = ""


# ---------------------------------------------------------------- routing
def resolve_route(path: str) -> Route:
    """The route for a proxy path; ProxyError 404 if unknown."""
    inference = path.startswith(INFERENCE_PREFIX + "/")
    rest = path[len(INFERENCE_PREFIX):] if inference else path
    embedding_only = rest.startswith("/embedding/v1/")
    if embedding_only:
        rest = rest[len("/embedding"):]
    if rest == "/v1/models":
        return Route("GET", "models", None, embedding_only)
    if rest.startswith("/v1/models/") and len(rest) > len("/v1/models/"):
        return Route("GET", "model", None, embedding_only)
    if embedding_only:
        if rest == "/v1/embeddings":
            return Route("POST", "forward", "embedding", True, rest)
    elif rest in FORWARDED_V1_ROUTES:
        return Route("POST", "forward", PATH_KINDS.get(rest), False, rest)
    elif inference and rest[1:] in ENGINE_ROUTES:
        return Route("POST", "forward", PATH_KINDS.get(rest), False, rest)
    raise ProxyError(404, f"Unknown inference path {path}.", code="not_found")



def _standby_entry(group: list[Standby]) -> dict:
    first = group[0]
    loading = any(s.state != "IDLE" for s in group)
    return {
        "id": first.model_name, "object": "model", "created": min(s.created for s in group), "owned_by": "xgen",
        "type": first.type, "backend": first.backend, "node": first.node,
        "aliases": sorted({a for s in group for a in s.aliases}), "replicas": 0, "instances": [],
        "status": "loading" if loading else "idle", "policy": "on_demand",
    }


def _model_entry(backends: list[Backend]) -> dict:
    first = backends[0]
    return {
        "status": "ready",
        "policy": first.policy,
        "id": first.model_name,
        "object": "model",
        "created": min(b.created for b in backends),
        "owned_by": "xgen",
        "type": first.type,
        "backend": first.backend,
        "node": first.node,
        "aliases": sorted({a for b in backends for a in b.aliases}),
        "replicas": len(backends),
        "instances": [{"id": b.instance_id, "replica": b.replica, "node": b.node, "gpus": list(b.gpus),
                       "state": "READY", "backend": b.backend, "in_flight": b.in_flight}
                      for b in sorted(backends, key=lambda b: (b.replica, b.instance_id))],
    }


def _adapter_entry(base_entry: dict, served: str) -> dict:
    """A LoRA adapter's model entry: its base's, named `<base>:<adapter>`, with `parent`."""
    return {**base_entry, "id": served, "parent": base_entry["id"], "adapter": served.split(":")[-1], "aliases": []}


async def list_models(*, kind: str | None = None, principal: Principal | None = None) -> dict:
    """Every READY model (one entry per served name, replicas listed) in OpenAI's list shape;
    for a key with allowed_models, only those."""
    snap = await routing_table.snapshot()
    entries = {name: _model_entry(group) for name, group in snap.by_name.items()}
    for name, group in snap.standby.items():  # on_demand models not READY: idle or loading
        entries.setdefault(name, _standby_entry(group))
    for served, base in snap.adapters.items():  # a LoRA adapter: a model of its own on the base's instances
        if base in entries:
            entries.setdefault(served, _adapter_entry(entries[base], served))
    data = [
        entry for name, entry in sorted(entries.items())
        if (kind is None or entry["type"] == kind) and (principal is None or principal.may_use(name))
    ]
    return {"object": "list", "data": data}


async def get_model(name: str, *, kind: str | None = None, principal: Principal | None = None) -> dict:
    """One READY model by served name; ProxyError 404 model_not_found otherwise (also for a model
    the key may not use: it is not in the key's list)."""
    snap = await routing_table.snapshot()
    served = snap.served_name(name)
    group = snap.by_name.get(served)
    entry = _model_entry(group) if group else (
        _standby_entry(snap.standby[served]) if snap.standby.get(served) else None)
    if entry is not None and name in snap.adapters:
        entry, served = _adapter_entry(entry, name), name
    if entry is None or (kind is not None and entry["type"] != kind) or (principal and not principal.may_use(served)):
        raise ProxyError(404, f"The model '{name}' does not exist or is not ready.", code="model_not_found")
    return entry



async def candidates_for(payload: dict, *, kind: str | None, principal: Principal | None = None) -> list[Backend]:
    """The READY replicas for the body's `model`, or for the path's kind when it names none
    (then only models the key may use); ColdStartNeeded for a model whose replicas are all IDLE."""
    snap = await routing_table.snapshot()
    model = payload.get("model")
    if model is not None:
        if not isinstance(model, str) or not model:
            raise ProxyError(400, "`model` must be a non-empty string.", code="invalid_request")
        served = snap.served_name(model)  # whether the key may use it: admission.admit_request
        group = snap.by_name.get(served)
        if group:
            return group
        standby = ondemand.needs_cold_start(snap, served)
        if standby:
            raise ColdStartNeeded(served, standby)
        if model in snap.known_names:
            raise ProxyError(503, f"No backend for '{model}' is ready yet.", code="no_backend")
        raise ProxyError(404, f"The model '{model}' does not exist or is not loaded.", code="model_not_found")
    group = snap.by_type.get(kind or "llm")
    if group and principal is not None and principal.models_limited:
        group = [b for b in group if principal.may_use(b.model_name)]
        if not group:
            team = principal.team
            if principal.allowed_models is None and team is not None and team.allowed_models is not None:
                whose, allowed = f"This key's team '{team.key_name}'", team.allowed_models
            else:
                whose, allowed = "This key", principal.allowed_models or frozenset()
            raise ProxyError(403, f"{whose} may use only {', '.join(sorted(allowed))}; "
                                  "name one as `model`.", code="model_not_allowed")
    if not group:
        raise ProxyError(503, f"No {kind or 'llm'} model is ready.", code="no_backend")
    return group


class ColdStartNeeded(ProxyError):
    """Every replica of the model is IDLE (or on its way up): a request starts one. Callers that
    do not start models answer it as it is (503 no_backend)."""

    def __init__(self, model: str, standby: list[Standby]) -> None:
        super().__init__(503, f"The model '{model}' is idle; it starts on a request.", code="no_backend",
                         headers=[(b"retry-after", b"5")])
        self.model = model
        self.standby = standby




def not_allowed(model: str, principal: Principal | None = None) -> ProxyError:
    """403 model_not_allowed; names the team when it is the team's allowed_models that refuse."""
    team = principal.team if principal is not None else None
    if team is not None and not team.may_use(model) and (principal is None or principal.allowed_models is None
                                                         or model in principal.allowed_models):
        return ProxyError(403, f"The team '{team.key_name}' of this API key may not use the model '{model}' "
                               f"(the team's allowed models).", code="model_not_allowed")
    return ProxyError(403, f"This API key may not use the model '{model}'.", code="model_not_allowed")



async def resolve_alias(payload: dict, body: bytes, *, form: bytes | None = None) -> tuple[dict, bytes]:
    """A `model` that is an alias stands for its served name: the body is rewritten to name it
    (backends such as vLLM check the name): the JSON object, or the `model` field of a multipart
    form (`form`: its Content-Type's parameters)."""
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        return payload, body
    snap = await routing_table.snapshot()
    name = snap.served_name(model)
    if name == model or model in snap.adapters:  # an adapter's name stays: admission and usage read it
        return payload, body
    if form is not None:  # only the form's model field was read: it alone is replaced
        span = form_model_span(body, form)
        if span is None:  # not reached: request_payload read this `model` from the same form
            return payload, body
        start, end = span
        return {"model": name}, body[:start] + name.encode() + body[end:]
    payload = {**payload, "model": name}
    return payload, json.dumps(payload).encode()


def with_adapters(candidates: list[Backend], body: bytes, requested: str | None) -> bytes:
    """The body a model with LoRA adapters gets (issue 27). llama-server applies adapters per
    request (`lora: [{id, scale}]`, ids in the load's order): a request for `<model>:<adapter>` gets
    that adapter at its load's scale (or the request's `lora_scale`) and every other at 0, and names
    the model; a request for the model itself gets them all at 0. The client's own `lora` is
    replaced. vLLM serves each adapter under its name (--lora-modules): the body goes as it is."""
    if not candidates or not candidates[0].adapters or candidates[0].backend != "llama-server":
        return body
    backend = candidates[0]
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return body
    if not isinstance(payload, dict):
        return body
    prefix = backend.model_name + ":"
    wanted = requested[len(prefix):] if isinstance(requested, str) and requested.startswith(prefix) else None
    override = payload.pop("lora_scale", None)
    if override is not None and (isinstance(override, bool) or not isinstance(override, int | float)
                                 or not -16 <= override <= 16):
        raise ProxyError(400, "`lora_scale` must be a number in -16..16.", code="invalid_request")
    lora = [{"id": i, "scale": (float(override) if override is not None else scale) if name == wanted else 0.0}
            for i, (name, scale) in enumerate(backend.adapters)]
    payload["lora"] = lora
    if wanted is not None:
        payload["model"] = backend.model_name
    return json.dumps(payload).encode()


def check_model_type(candidates: list[Backend], route: Route, payload: dict) -> None:
    """Type rules: chat, completions, responses and messages only to LLMs, embeddings only to
    embedding models, rerank and score only to rerank models; ProxyError 400 `model_type_mismatch`
    for a named model of another type."""
    if route.kind is None or not candidates or candidates[0].type == route.kind:
        return
    name = payload.get("model") or candidates[0].model_name
    has, needs = (f"a{'n' if kind[0] in 'aeiou' else ''} {kind}" for kind in (candidates[0].type, route.kind))
    raise ProxyError(400, f"The model '{name}' is {has} model; {route.upstream_path} needs {needs} model.",
                     code="model_type_mismatch")


def usage_operation(upstream_path: str) -> str:
    """What admit_request needs of a route: `chat` and `completions` get usage asked of a stream."""
    return {"/v1/chat/completions": "chat", "/v1/completions": "completions",
            "/v1/embeddings": "embeddings"}.get(upstream_path, "forward")


def backend_serves(backend: Backend, path: str) -> bool:
    """Whether the backend kind answers `path` itself (its adapter knows); unknown kinds pass."""
    adapter = ADAPTERS.get(backend.backend)
    return adapter is None or adapter.serves(path)

