"""The inference operations in the OpenAPI docs, calling the same core as the proxy.

Under the ASGI app, `/api/inference/` is served by serving.proxy.app.proxy_app ahead of Django
(the fast path clients use); these Ninja views make the same operations appear at /api/docs
and answer identically when Django is reached directly (e.g. the test client).
"""
from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from ninja import Field, Router, Schema
from pydantic import ConfigDict

from serving.proxy import app as proxy_app
from serving.proxy import metrics
from serving.proxy.app import candidates_for, parse_body, request_id_from
from serving.proxy.errors import ProxyError
from serving.proxy.upstream import open_upstream

router = Router()


class ModelEntry(Schema):
    id: str
    object: str = "model"
    created: int
    owned_by: str
    type: str = Field(description="llm or embedding")
    backend: str
    node: str = Field(description="node of the first replica")
    replicas: int
    instances: list[dict]


class ModelList(Schema):
    object: str = "list"
    data: list[ModelEntry]


class _OpenAIBody(Schema):
    model_config = ConfigDict(extra="allow")
    model: str | None = Field(None, description="a served model_name; without it, routed by path type")


class ChatMessage(Schema):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list | None = None


class ChatCompletionRequest(_OpenAIBody):
    messages: list[ChatMessage]
    stream: bool = False
    max_tokens: int | None = None
    temperature: float | None = None


class CompletionRequest(_OpenAIBody):
    prompt: str | list
    stream: bool = False
    max_tokens: int | None = None
    temperature: float | None = None


class EmbeddingRequest(_OpenAIBody):
    input: str | list


def _error(exc: ProxyError) -> HttpResponse:
    metrics.record_rejected(exc.code or str(exc.status))
    return HttpResponse(exc.body(), status=exc.status, content_type="application/json")


async def _forward(request: HttpRequest, kind: str) -> HttpResponse:
    raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()]
    request_id = request_id_from(dict(raw_headers))
    body = request.body
    try:
        if len(body) > settings.PROXY_MAX_BODY_BYTES:
            raise ProxyError(413, "The request body is too large.", code="request_too_large")
        candidates = await candidates_for(parse_body(body), kind=kind)
        reply = await open_upstream(
            path=request.path, query=request.META.get("QUERY_STRING", "").encode("latin-1"), body=body,
            candidates=candidates, headers=raw_headers, request_id=request_id,
        )
    except ProxyError as exc:
        return _error(exc)
    response = StreamingHttpResponse(reply.chunks(), status=reply.status)
    for name, value in reply.headers():
        if name not in (b"content-length",):
            response[name.decode("latin-1")] = value.decode("latin-1")
    return response


@router.get("/v1/models", response=ModelList, summary="List READY models")
async def list_models(request: HttpRequest):
    """Every READY model, one entry per served name with its replicas."""
    return await proxy_app.list_models()


@router.get("/v1/models/{model}", response=ModelEntry, summary="One READY model")
async def get_model(request: HttpRequest, model: str):
    """A READY model by served name; 404 model_not_found otherwise."""
    try:
        return await proxy_app.get_model(model)
    except ProxyError as exc:
        return _error(exc)


@router.post("/v1/chat/completions", summary="Chat completion (stream: true for SSE)")
async def chat_completions(request: HttpRequest, payload: ChatCompletionRequest):
    """Routed by `model` (or to an LLM); streams chunk by chunk with `stream: true`."""
    return await _forward(request, "llm")


@router.post("/v1/completions", summary="Text completion (stream: true for SSE)")
async def completions(request: HttpRequest, payload: CompletionRequest):
    """Routed by `model` (or to an LLM)."""
    return await _forward(request, "llm")


@router.post("/v1/embeddings", summary="Embeddings")
async def embeddings(request: HttpRequest, payload: EmbeddingRequest):
    """Routed by `model` (or to an embedding model)."""
    return await _forward(request, "embedding")


@router.get("/embedding/v1/models", response=ModelList, summary="List READY embedding models")
async def list_embedding_models(request: HttpRequest):
    """READY embedding models only."""
    return await proxy_app.list_models(kind="embedding")


@router.post("/embedding/v1/embeddings", summary="Embeddings (explicit embedding route)")
async def embedding_embeddings(request: HttpRequest, payload: EmbeddingRequest):
    """Routed by `model`, or to an embedding model."""
    return await _forward(request, "embedding")

