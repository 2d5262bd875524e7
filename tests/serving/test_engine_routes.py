"""The proxy's inference routes held against each engine's own route table (issue 34 #8): every
route an engine registers is either one the console forwards to it (its adapter's
inference_routes) or refused here with the reason, and no refused route is reachable through the
proxy. Tables: llama-server's from the llama.cpp its pinned llama-cpp-python vendors (the sdist the
build uses), llama-cpp-python's from its installed FastAPI app's source, vLLM's recorded from real
wheels by bench/record_vllm_routes.py into tests/serving/vllm_routes/. A new engine version with a
new route fails here until the route is classified."""
from __future__ import annotations

import importlib.util
import re
import tarfile
from functools import cache
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest
from django.conf import settings

from serving.adapters import get_adapter
from serving.proxy.errors import ProxyError
from serving.proxy.routing import ENGINE_ROUTES, FORWARDED_V1_ROUTES, resolve_route

ALIAS = "an alias of a route the console forwards under its /v1/ name (or as /api/inference/<route>)"
CONSOLE = "the console answers it itself"
LLAMA_SERVER_REFUSED = {
    "/v1/chat/completions/control": "session control: another request with the stream's id ends or steers it",
    "/v1/streams/lookup": "resumable-stream sessions (X-Conversation-Id): a stream outlives its client",
    "/v1/stream": "resumable-stream sessions: reads or deletes another client's stream",
    "/slots": "the slots of every client (their prompts)",
    "/slots/:id_slot": "saves, restores or erases a slot's KV cache (files on the node)",
    "/props": "POST changes the server's settings",
    "/lora-adapters": "hot-swaps LoRA adapters for every client",
    "/models": "router mode's model list and deletion",
    "/models/load": "router mode: loads a model",
    "/models/unload": "router mode: unloads a model",
    "/models/sse": "router mode's event stream",
    "/metrics": "the engine's own metrics (the console exports its own)",
    "/health": CONSOLE, "/v1/health": CONSOLE, "/v1/models": CONSOLE,
    "/cors-proxy": "fetches any URL from the node",
    "/tools": "runs tools on the node",
    **{path: ALIAS for path in ("/completion", "/completions", "/chat/completions", "/responses",
                                "/audio/transcriptions", "/embedding", "/embeddings", "/reranking",
                                "/chat/completions/input_tokens", "/responses/input_tokens")},
}
LLAMA_CPP_PYTHON_REFUSED = {
    "/v1/models": CONSOLE,
    "/v1/engines/copilot-codex/completions": "a Copilot alias of /v1/completions",
    "/extras/tokenize": "not the engines' /tokenize shape (the console's /api/inference/tokenize is llama-server's "
                        "and vLLM's)",
    "/extras/tokenize/count": "as /extras/tokenize",
    "/extras/detokenize": "as /extras/tokenize",
}
ADMIN = "admin or control of the whole server"
VLLM_REFUSED = {
    **{path: ADMIN for path in (
        "/sleep", "/wake_up", "/is_sleeping", "/release_kv_cache_memory", "/reset_prefix_cache", "/reset_mm_cache",
        "/reset_encoder_cache", "/collective_rpc", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
        "/start_profile", "/stop_profile", "/pause", "/resume", "/is_paused", "/abort_requests",
        "/inference/v1/abort_requests", "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine",
        "/start_weight_update", "/start_draft_weight_update", "/update_weights", "/finish_weight_update",
        "/update_weight_version", "/weight_info", "/weight_checker", "/get_world_size", "/scale_elastic_ep",
        "/is_scaling_elastic_ep", "/fault_tolerance/apply", "/fault_tolerance/status", "/server_info", "/load",
        "/version", "/kv_event_sources", "/tokenizer_info", "/docs", "/ping", "/invocations")},
    "/v1/responses/{response_id}": "a stored response of any client, by id",
    "/v1/responses/{response_id}/cancel": "cancels any client's background response, by id",
    "/health": CONSOLE, "/ready": CONSOLE, "/readyz": CONSOLE, "/v1/models": CONSOLE,
    "/generate": "the demo server's route (vllm.entrypoints.api_server), not the OpenAI server's",
    "/inference/v1/generate": "token-in, token-out for disaggregated serving: not a client route",
    **{path: "renders or derenders a prompt for scale-out serving: not a client route" for path in (
        "/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render", "/v1/responses/render",
        "/v1/chat/completions/derender", "/v1/completions/derender")},
    "/v1/chat/completions/batch": "many chats in one request: not an OpenAI route the console meters",
    "/v2/rerank": "Cohere's v2 shape: the console forwards /v1/rerank", "/v2/embed": "Cohere's v2 shape",
    "/cohere/v2/chat": "Cohere's shape", "/cohere/v2/chat/render": "Cohere's shape",
    "/generative_scoring": "not an OpenAI route", "/v1/systemone": "not an OpenAI route",
    "/v1/decisions": "not an OpenAI route",
}
VLLM_DIR = Path(__file__).parent / "vllm_routes"
ROUTE_RE = re.compile(r'ctx_http\.(get|post|del)\s*\(\s*"([^"]+)"')
FASTAPI_ROUTE_RE = re.compile(r'@router\.(get|post|put|delete)\(\s*"([^"]+)"')


@cache
def llama_server_routes() -> frozenset[str]:
    """The paths llama-server registers (tools/server/server.cpp of the pinned llama.cpp)."""
    pinned = installed_version("llama_cpp_python")
    sdist = Path(settings.CACHE_DIR) / "sdist" / f"llama_cpp_python-{pinned}.tar.gz"
    assert sdist.is_file(), f"{sdist} is missing: deploy/build_llama_cpp.sh {pinned} downloads it"
    with tarfile.open(sdist) as archive:
        source = archive.extractfile(f"llama_cpp_python-{pinned}/vendor/llama.cpp/tools/server/server.cpp").read()
    routes = frozenset(path for _, path in ROUTE_RE.findall(source.decode()))
    assert len(routes) > 40, routes  # the parse still finds the table
    return routes


def llama_cpp_python_routes() -> frozenset[str]:
    """The paths llama-cpp-python's server registers (its installed llama_cpp/server/app.py)."""
    spec = importlib.util.find_spec("llama_cpp")
    source = (Path(spec.origin).parent / "server" / "app.py").read_text()
    routes = frozenset(path for _, path in FASTAPI_ROUTE_RE.findall(source))
    assert {"/v1/chat/completions", "/v1/models"} <= routes, routes
    return routes


def vllm_routes(version: str) -> frozenset[str]:
    lines = (VLLM_DIR / f"{version}.txt").read_text().splitlines()
    return frozenset(line.split()[1] for line in lines if line and not line.startswith("#"))


VLLM_VERSIONS = sorted((p.stem for p in VLLM_DIR.glob("*.txt")), key=lambda v: tuple(map(int, v.split("."))))


def _check(engine: str, table: frozenset[str], refused: dict[str, str], version: str = "") -> None:
    adapter = get_adapter(engine)
    unclassified = table - adapter.inference_routes - set(refused)
    assert not unclassified, f"{engine} {version}: classify {sorted(unclassified)} (forward or refuse, and why)"
    served = {path for path in adapter.inference_routes if adapter.serves(path, version)}
    assert served <= table, f"{engine} {version} lacks {sorted(served - table)}"
    assert not adapter.inference_routes & set(refused)
    for path in table & set(refused):  # never reachable: the proxy knows no such route, or not for this engine
        for asked in (path, "/api/inference" + path):
            try:
                route = resolve_route(asked)
            except ProxyError as exc:
                assert exc.status == 404
                continue
            assert not adapter.serves(route.upstream_path, version), (engine, asked)


def test_llama_server_routes():
    _check("llama-server", llama_server_routes(), LLAMA_SERVER_REFUSED)


def test_llama_cpp_python_routes():
    _check("llama-cpp-python", llama_cpp_python_routes(), LLAMA_CPP_PYTHON_REFUSED)


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_vllm_routes(version):
    _check("vllm", vllm_routes(version), VLLM_REFUSED, version)


def test_vllm_recordings_are_there():
    assert {"0.15.1", "0.17.0", "0.33.0"} <= set(VLLM_VERSIONS)


def test_the_session_and_admin_routes_of_the_issue_are_refused():
    for path in ("/v1/streams/lookup", "/v1/chat/completions/control", "/v1/load_lora_adapter",
                 "/v1/unload_lora_adapter", "/v1/stream", "/api/inference/slots", "/api/inference/props",
                 "/api/inference/lora-adapters", "/api/inference/sleep", "/api/inference/collective_rpc"):
        with pytest.raises(ProxyError) as caught:
            resolve_route(path)
        assert caught.value.status == 404
    # Every route the proxy knows is some engine's inference route.
    every = set().union(*(get_adapter(e).inference_routes for e in ("llama-server", "llama-cpp-python", "vllm")))
    assert FORWARDED_V1_ROUTES <= every and {"/" + r for r in ENGINE_ROUTES} <= every
