"""The inference operations in the OpenAPI docs, calling the same core as the proxy.

Under the ASGI app, `/api/inference/` is served by serving.proxy.app.proxy_app ahead of Django
(the fast path clients use); these Ninja views make the same operations appear at /api/docs
and answer identically when Django is reached directly (e.g. the test client). The proxy also
forwards any other `POST /v1/<path>` naming a `model`; the docs list the ones clients use most.
"""
from __future__ import annotations

import asyncio
import json
from typing import Literal

from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.middleware.csrf import get_token
from ninja import Field, Router, Schema
from pydantic import ConfigDict

from accounts.credentials import Principal, authenticate
from accounts.errors import ErrorAnswer
from serving.proxy import app as proxy_app
from serving.proxy import metrics, routing
from serving.proxy.errors import ProxyError

router = Router()


class ModelEntry(Schema):
    id: str
    object: str = "model"
    created: int
    owned_by: str
    type: str = Field(description="llm, embedding or rerank")
    backend: str
    node: str = Field(description="node of the first replica")
    aliases: list[str] = Field(default_factory=list, description="more names that route to this model")
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


class ResponsesRequest(_OpenAIBody):
    model: str
    input: str | list
    stream: bool = False


class RerankRequest(Schema):
    model_config = ConfigDict(extra="allow")
    model: str | None = Field(None, description="a served rerank model_name (or any rerank model)")
    query: str
    documents: list[str] = Field(description="the texts to score against the query (TEI's `texts` also works)")
    top_n: int | None = None


class ScoreRequest(Schema):
    model_config = ConfigDict(extra="allow")
    model: str | None = Field(None, description="a served rerank model_name (or any rerank model)")
    text_1: str | list[str]
    text_2: str | list[str]


class AnthropicMessage(Schema):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | list


class MessagesRequest(Schema):
    model_config = ConfigDict(extra="allow")
    model: str = Field(description="a served model_name")
    max_tokens: int
    messages: list[AnthropicMessage]
    system: str | list | None = None
    stream: bool = False


class CountTokensRequest(Schema):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[AnthropicMessage]
    system: str | list | None = None


class EngineRequest(Schema):
    model_config = ConfigDict(extra="allow")
    model: str = Field(description="a served model_name; the rest of the body is the engine's")


EngineRoute = Literal["tokenize", "detokenize", "apply-template", "infill", "rerank", "score", "pooling", "classify"]


def _error(exc: ErrorAnswer) -> HttpResponse:
    metrics.record_rejected(exc.code or str(exc.status))
    response = HttpResponse(exc.body(), status=exc.status, content_type="application/json")
    for name, value in exc.headers:
        response[name.decode("latin-1")] = value.decode("latin-1")
    return response


def _raw_headers(request: HttpRequest) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()]


async def _principal(request: HttpRequest) -> Principal | None:
    """The caller as the proxy sees it (with its key's limits); Ninja's auth has let it in already."""
    try:
        return await authenticate(dict(_raw_headers(request)), method=request.method,
                                  scheme="https" if request.is_secure() else "http")
    except ErrorAnswer:
        return None


async def _answer(request: HttpRequest, chunks, status: int, headers) -> StreamingHttpResponse:
    """The proxy's answer as Django's response. Under an ASGI server the view's event loop lives
    as long as the response, so the body streams from the backend as it comes. Anywhere else
    (the WSGI handler, Django's test client) the view's loop ends when the view returns, and with
    it the tasks and connections the stream is read from: there the body is read here, and the
    response replays it (an async iterator bound to no loop)."""
    if not isinstance(request, ASGIRequest):
        body = [chunk async for chunk in chunks]
        chunks = _replay(body)
    response = StreamingHttpResponse(chunks, status=status)
    for name, value in headers:
        if name != b"content-length":
            response[name.decode("latin-1")] = value.decode("latin-1")
    return response


async def _replay(body: list[bytes]):
    for chunk in body:
        yield chunk


def _proxy_scope(request: HttpRequest, *, path: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> dict:
    """The ASGI scope the proxy app would have been handed for this request."""
    peer = str(request.META.get("REMOTE_ADDR") or "")
    return {
        "type": "http", "method": request.method, "path": path or request.path, "scheme": request.scheme,
        "query_string": request.META.get("QUERY_STRING", "").encode("latin-1") if path is None else b"",
        "headers": _raw_headers(request) if headers is None else headers,
        "client": (peer, 0) if peer else None,
    }


async def run_proxy(scope: dict, body: bytes):
    """Run the proxy's own ASGI app on one request: (its response start message or None, an async
    iterator of its body chunks). Every caller reaching a backend from Django comes through here, so
    keys, limits, quotas, the queue, cold starts, usage and the request log hold for it as for /v1/."""
    queue: asyncio.Queue = asyncio.Queue()
    delivered = asyncio.Event()

    async def receive() -> dict:
        if not delivered.is_set():
            delivered.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # Django tells no disconnect: wait until the answer is done
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await queue.put(message)

    task = asyncio.ensure_future(proxy_app.proxy_app(scope, receive, send))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    start = await queue.get()

    async def chunks():
        try:
            while True:
                message = await queue.get()
                if message is None:
                    return
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
        finally:
            if not task.done():
                task.cancel()

    return start, chunks()


async def _via_proxy(request: HttpRequest) -> HttpResponse:
    """Answer through the proxy's own ASGI app (the same core as /api/inference/ under ASGI),
    streamed back through Django."""
    start, chunks = await run_proxy(_proxy_scope(request), request.body)
    if start is None:  # ended without answering (cannot happen: the app always answers)
        return _error(ProxyError(502, "The proxy gave no answer.", code="upstream_error"))
    if start["status"] >= 400 and (b"content-type", b"text/event-stream") not in start["headers"]:
        # An error is a small whole body: a plain response, as Django's own JSON errors are.
        response = HttpResponse(b"".join([chunk async for chunk in chunks]), status=start["status"])
        for name, value in start["headers"]:
            if name != b"content-length":
                response[name.decode("latin-1")] = value.decode("latin-1")
        return response
    return await _answer(request, chunks, start["status"], start["headers"])


SESSION_DROP = frozenset({b"authorization", b"x-api-key", b"content-type", b"content-length", b"transfer-encoding",
                          b"cookie", b"x-csrftoken"})


def session_headers(request: HttpRequest) -> list[tuple[bytes, bytes]]:
    """The request's headers for the proxy as its signed-in user: its session cookie, and (Django's
    CSRF check has passed for this request) its CSRF secret as both the cookie and the header the
    proxy checks; no key of its own, so it acts as the session."""
    get_token(request)  # the request's CSRF secret, made if it had none (a client exempt from the check)
    cookies = {**request.COOKIES, settings.CSRF_COOKIE_NAME: request.META["CSRF_COOKIE"]}
    headers = [(k, v) for k, v in _raw_headers(request) if k not in SESSION_DROP]
    headers.append((b"cookie", "; ".join(f"{k}={v}" for k, v in cookies.items()).encode("latin-1")))
    headers.append((b"x-csrftoken", request.META["CSRF_COOKIE"].encode("latin-1")))
    return headers


async def ask_as_session(request: HttpRequest, path: str, payload: dict) -> tuple[int, dict]:
    """POST `payload` as JSON to the proxy's `path` as the request's signed-in user
    (session_headers): (status, JSON answer). For the server-side playground: admitted, queued,
    counted and logged as the user's like any /v1/ request."""
    headers = [*session_headers(request), (b"content-type", b"application/json")]
    start, chunks = await run_proxy(_proxy_scope(request, path=path, headers=headers), json.dumps(payload).encode())
    data = b"".join([chunk async for chunk in chunks])
    if start is None:
        return 502, {"error": {"message": "The proxy gave no answer.", "code": "upstream_error"}}
    try:
        answer = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        answer = {"error": {"message": data[:200].decode("utf-8", "replace"), "code": "upstream_error"}}
    return start["status"], answer if isinstance(answer, dict) else {"data": answer}


@router.get("/v1/models", response=ModelList, summary="List READY models")
async def list_models(request: HttpRequest):
    """Every READY model, one entry per served name with its replicas (for a key with
    allowed_models, only those)."""
    return await routing.list_models(principal=await _principal(request))


@router.get("/v1/models/{model}", response=ModelEntry, summary="One READY model")
async def get_model(request: HttpRequest, model: str):
    """A READY model by served name; 404 model_not_found otherwise."""
    try:
        return await routing.get_model(model, principal=await _principal(request))
    except ProxyError as exc:
        return _error(exc)


@router.post("/v1/chat/completions", summary="Chat completion (stream: true for SSE)")
async def chat_completions(request: HttpRequest, payload: ChatCompletionRequest):
    """Routed by `model` (or to an LLM); streams chunk by chunk with `stream: true`."""
    return await _via_proxy(request)


@router.post("/v1/completions", summary="Text completion (stream: true for SSE)")
async def completions(request: HttpRequest, payload: CompletionRequest):
    """Routed by `model` (or to an LLM)."""
    return await _via_proxy(request)


@router.post("/v1/embeddings", summary="Embeddings")
async def embeddings(request: HttpRequest, payload: EmbeddingRequest):
    """Routed by `model` (or to an embedding model)."""
    return await _via_proxy(request)


@router.get("/embedding/v1/models", response=ModelList, summary="List READY embedding models")
async def list_embedding_models(request: HttpRequest):
    """READY embedding models only."""
    return await routing.list_models(kind="embedding", principal=await _principal(request))


@router.post("/embedding/v1/embeddings", summary="Embeddings (explicit embedding route)")
async def embedding_embeddings(request: HttpRequest, payload: EmbeddingRequest):
    """Routed by `model`, or to an embedding model."""
    return await _via_proxy(request)



@router.post("/v1/responses", summary="OpenAI Responses API (where the backend serves it)")
async def responses(request: HttpRequest, payload: ResponsesRequest):
    """Forwarded to an LLM backend that serves /v1/responses (llama-server, vLLM); elsewhere
    404 `unsupported_by_backend` naming the backend."""
    return await _via_proxy(request)


@router.post("/v1/rerank", summary="Rerank documents against a query (rerank models only)")
async def rerank(request: HttpRequest, payload: RerankRequest):
    """Forwarded to a rerank model (`server_type: "rerank"`); the backend's own answer comes back
    (llama-server and vLLM: `{"model", "results": [{"index", "relevance_score"}], "usage"}`).
    Another kind of model: 400 `model_type_mismatch`."""
    return await _via_proxy(request)


@router.post("/v1/score", summary="Score text pairs (rerank models only; vLLM)")
async def score(request: HttpRequest, payload: ScoreRequest):
    """vLLM's score API on a rerank model; a backend without it answers its own 404."""
    return await _via_proxy(request)


@router.post("/v1/messages", summary="Anthropic Messages API (stream: true for SSE)")
async def messages(request: HttpRequest, payload: MessagesRequest):
    """Anthropic's Messages API: forwarded natively where the backend serves it, translated to
    and from chat completions elsewhere. `x-api-key` works like a bearer key; errors come in
    Anthropic's shape `{"type": "error", "error": {"type", "message"}}`."""
    return await _via_proxy(request)


@router.post("/v1/messages/count_tokens", summary="Anthropic token count")
async def count_tokens(request: HttpRequest, payload: CountTokensRequest):
    """`{"input_tokens": n}` for a Messages request, from the backend's own tokenizer and template."""
    return await _via_proxy(request)


@router.post("/{route}", summary="An engine route (tokenize, detokenize, apply-template, rerank, ...)")
async def engine_route(request: HttpRequest, route: EngineRoute, payload: EngineRequest):
    """The engine's own route of that name on the named model's backend; what the backend
    answers (its 404 for a route it lacks) comes back, in the OpenAI shape if it is not JSON."""
    return await _via_proxy(request)
