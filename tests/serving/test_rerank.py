"""Rerank models (issue 15): `server_type: "rerank"` starts llama-server with `--reranking` and vLLM
with its scoring runner (per its version); llama-cpp-python, whose server has no rerank route, is
never chosen for one. The end-to-end load runs the real agent and a real llama-server on the tiny
reranker GGUF the test writes (warm-up through /v1/rerank)."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from asgiref.sync import sync_to_async

from serving.adapters import LaunchSpec, get_adapter
from serving.control.selection import BackendUnavailable, choose_backend
from serving.models import InstanceState, ModelInstance
from tests.conftest import bearer
from tests.serving.conftest import LLAMA_CPP_PYTHON, NODE, llama_server_row, wait_state

MODEL_DIR = Path("/models/huggingface/BAAI_bge-reranker-base")
GGUF = Path("/models/gguf/tiny/rerank.gguf")
LLAMA_SERVER_CPU = {"name": "llama-server", "available": True, "version": "b6500", "flavour": "cpu",
                    "path": "/opt/llama-server", "reason": ""}


def spec(**kw) -> LaunchSpec:
    base = dict(model_file=MODEL_DIR, model_name="rr", server_type="rerank", host="127.0.0.1", port=18001)
    base.update(kw)
    return LaunchSpec(**base)


# ---------------------------------------------------------------- command lines
# vLLM's docs: `--task score` through 0.10.0; from 0.10.1 the pooling runner (the model's
# classification head makes it a scorer; `--convert classify` for a causal LM turned reranker).
@pytest.mark.parametrize("version,flags", [
    ("0.9.2", ["--task", "score"]),
    ("0.10.0", ["--task", "score"]),
    ("0.10.1", ["--runner", "pooling"]),
    ("0.15.1", ["--runner", "pooling"]),
    ("0.17.0", ["--runner", "pooling"]),
    ("0.33.0", ["--runner", "pooling"]),
    ("", ["--runner", "pooling"]),
])
def test_vllm_rerank_flags_follow_the_installed_version(version, flags):
    vllm = get_adapter("vllm")
    cmd = vllm.build_command(spec(version=version))
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[3:11] == ["--model", str(MODEL_DIR), "--served-model-name", "rr", "--host", "127.0.0.1",
                         "--port", "18001"]
    assert cmd[11:] == flags
    if flags[0] == "--runner":
        # A second runner from extra_args would contradict the adapter's; a conversion is the model's business.
        cmd = vllm.build_command(spec(version=version, extra_args={"--runner": "generate", "--convert": "classify"}))
        assert cmd[11:] == ["--runner", "pooling", "--convert", "classify"]
    else:
        cmd = vllm.build_command(spec(version=version, extra_args={"--task": "generate"}))
        assert cmd[11:] == ["--task", "score"]
    assert vllm.warmup_request(spec(version=version)) == (
        "/v1/rerank", {"model": "rr", "query": "warm-up", "documents": ["warm-up"]})


def test_llama_server_rerank_command():
    ls = get_adapter("llama-server")
    cmd = ls.build_command(spec(model_file=GGUF, flavour="cpu", extra_args={"--ctx-size": 512}))
    assert cmd[:9] == ["llama-server", "-m", str(GGUF), "--alias", "rr", "--host", "127.0.0.1", "--port", "18001"]
    assert cmd[9] == "--reranking" and "--embeddings" not in cmd and "--pooling" not in cmd
    assert cmd[cmd.index("--ctx-size") + 1] == "512"
    assert ls.warmup_request(spec())[0] == "/v1/rerank"
    llm = ls.build_command(spec(model_file=GGUF, server_type="llm"))
    assert "--reranking" not in llm


# ---------------------------------------------------------------- which backend
@pytest.mark.parametrize("gpu,have,want", [
    ("CPU", [("llama-cpp-python", "cpu"), ("llama-server", "cpu")], ("llama-server", "cpu")),
    ("NVIDIA", [("llama-cpp-python", "cuda"), ("llama-server", "cpu")], ("llama-server", "cpu")),
    ("NVIDIA", [("llama-server", "cuda"), ("llama-cpp-python", "cuda")], ("llama-server", "cuda")),
    ("AMD_RDNA", [("llama-server", "vulkan")], ("llama-server", "vulkan")),
])
def test_a_gguf_reranker_goes_to_llama_server(gpu, have, want):
    backends = [{"name": n, "flavour": f, "available": True, "version": "1", "path": f"/opt/{n}"} for n, f in have]
    choice = choose_backend(fmt="gguf", gpu_type=gpu, backends=backends, server_type="rerank")
    assert (choice.backend, choice.flavour) == want
    assert "llama-cpp-python" not in choice.reason  # not named as the one missing: it never serves a reranker


def test_llama_cpp_python_never_serves_a_reranker():
    backends = [dict(LLAMA_CPP_PYTHON)]
    with pytest.raises(BackendUnavailable, match="llama-cpp-python cannot serve a rerank model; llama-server"):
        choose_backend(fmt="gguf", gpu_type="CPU", backends=backends, requested="llama-cpp-python",
                       server_type="rerank")
    with pytest.raises(BackendUnavailable, match=r"no backend on node-a can serve a rerank gguf model.*llama-server"):
        choose_backend(fmt="gguf", gpu_type="CPU", backends=backends, node_name="node-a", server_type="rerank")
    assert choose_backend(fmt="gguf", gpu_type="CPU", backends=backends).backend == "llama-cpp-python"


def test_a_huggingface_reranker_goes_to_vllm():
    backends = [{"name": "vllm", "flavour": "cuda", "available": True, "version": "0.17.0", "path": ""}]
    choice = choose_backend(fmt="huggingface", gpu_type="NVIDIA", backends=backends, server_type="rerank")
    assert choice.backend == "vllm"


# ---------------------------------------------------------------- the load request
@pytest.fixture
def node(serving_settings, db):
    """conftest's node with llama-server beside llama-cpp-python: reranking needs llama-server."""
    from hardware.services import register_node

    n = register_node(name=NODE, address="127.0.0.1")
    n.backends = [LLAMA_CPP_PYTHON, LLAMA_SERVER_CPU]
    n.save()
    return n


def _load(client, key, body):
    return client.post("/api/management/load", body, content_type="application/json", **bearer(key))


def test_the_load_request_takes_server_type_rerank(client, node, operator, tiny_reranker):
    r = _load(client, operator.key, {"model_path": str(tiny_reranker), "model_name": "rr", "server_type": "rerank"})
    assert r.status_code == 202, r.content
    assert r.json()["backend"] == "llama-server"  # the CPU default for GGUF is llama-cpp-python, which has no rerank
    inst = ModelInstance.objects.get(pk=r.json()["id"])
    assert inst.type == "rerank" and inst.plan["server_type"] == "rerank"
    assert "--reranking" in inst.plan["argv"]
    one = client.get(f"/api/management/instances/{inst.pk}", **bearer(operator.key)).json()
    assert "--reranking" in one["command"]


def test_a_rerank_load_on_llama_cpp_python_or_of_an_unknown_type_is_refused(client, node, operator, tiny_reranker):
    r = _load(client, operator.key, {"model_path": str(tiny_reranker), "model_name": "rr", "server_type": "rerank",
                                     "backend": "llama-cpp-python"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "backend_unavailable", r.content
    assert "llama-server" in r.json()["error"]["message"]
    r = _load(client, operator.key, {"model_path": str(tiny_reranker), "server_type": "reranker"})
    assert r.status_code == 400 and "llm, embedding or rerank" in r.json()["error"]["message"], r.content
    assert not ModelInstance.objects.exists()


def test_the_load_dialog_offers_a_reranker(client, node, operator, tiny_reranker):
    client.force_login(operator.user)
    page = client.get("/instances/new/").content.decode()
    assert 'value="rerank"' in page
    verdict = client.get("/instances/new/verdict", {"model_path": str(tiny_reranker), "server_type": "rerank"})
    assert "llama-server" in verdict.content.decode() and "--reranking" in verdict.content.decode()


# ---------------------------------------------------------------- a real load, end to end
async def test_a_reranker_loads_on_real_llama_server_and_ranks(agent, tiny_reranker, viewer):
    from serving.control.services import request_load

    if not llama_server_row()["available"]:
        pytest.fail(f"{llama_server_row()['reason']}; build it with deploy/build_llama_cpp.sh")
    inst = await sync_to_async(request_load)(model_path=str(tiny_reranker), model_name="tiny-rr",
                                             server_type="rerank", extra_args={"--ctx-size": "512"})
    agent.nudge()
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR}, timeout=90)
    assert inst.state == InstanceState.READY, inst.last_error  # ready = /health, then a /v1/rerank warm-up
    assert inst.backend == "llama-server" and inst.type == "rerank"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{inst.port}", timeout=30, trust_env=False,
                                 headers={"Authorization": f"Bearer {inst.backend_key}"}) as client:
        r = await client.post("/v1/rerank", json={"model": "tiny-rr", "query": "hello world",
                                                  "documents": ["the GPU", "hello world", "water"]})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert sorted(row["index"] for row in results) == [0, 1, 2]
    scores = [row["relevance_score"] for row in results]
    assert scores == sorted(scores, reverse=True)

    # The instance page: the playground ranks the documents under the query; the snippet is a rerank.
    def page_and_playground() -> tuple[str, str, str]:
        from django.test import Client

        client = Client()
        client.force_login(viewer.user)
        page = client.get(f"/instances/{inst.pk}/").content.decode()
        ranked = client.post(f"/instances/{inst.pk}/playground",
                             {"prompt": "hello world\nthe GPU\nhello world\nwater"}).content.decode()
        alone = client.post(f"/instances/{inst.pk}/playground", {"prompt": "only a query"}).content.decode()
        return page, ranked, alone

    page, ranked, alone = await sync_to_async(page_and_playground)()
    assert "/rerank" in page and '"documents"' in page.replace("&quot;", '"') and "Rerank" in page
    assert ranked.count("<li>") == 3 and "the GPU" in ranked and "water" in ranked and "msg-error" not in ranked
    assert "at least one document" in alone
