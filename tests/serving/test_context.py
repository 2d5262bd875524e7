"""The context a llama.cpp backend runs with is the console's choice, and the estimate is for it.

llama-server's own default is the model's trained context (and on a GPU it shrinks that to take
all free memory but 1 GiB); llama-cpp-python's is 2,048 tokens whatever the model. The plan sets
the context: the model's own where its KV cache fits, else the largest power of two below it that
fits (down to 4,096), and says so in the verdict. The tiny model's KV cache is 512 bytes a token
(2 layers, 64 wide, f16 K and V), so a trained context of 1,048,576 tokens holds 512 MiB of it.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from serving.control.planning import LoadRefused, context_choices, plan_load
from tests.serving.conftest import NODE, node_backends, set_backends

pytestmark = pytest.mark.django_db

LLAMA_SERVER_CUDA = {"name": "llama-server", "available": True, "version": "b6500", "flavour": "cuda",
                     "path": "/opt/llama-server", "reason": ""}
MILLION = 1 << 20


@pytest.fixture(scope="module")
def long_gguf(tmp_path_factory) -> Path:
    from hub.demo import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("long") / "long.gguf", n_ctx=MILLION)


def _flag(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


def _gpu_node(node, free_mib: int):
    from hardware.models import GpuDevice

    node.backends = [LLAMA_SERVER_CUDA]
    node.save()
    GpuDevice.objects.create(node=node, index=0, vendor="NVIDIA", type="NVIDIA", name="L4",
                             memory_total_mib=24000, memory_used_mib=24000 - free_mib)


def test_the_contexts_tried_are_the_models_own_then_powers_of_two_down_to_4096():
    assert context_choices({"n_layers": 2, "n_embd": 64, "n_head": 4, "ctx": 2048}) == [2048]
    assert context_choices({"n_layers": 2, "n_embd": 64, "n_head": 4, "ctx": 4096}) == [4096]
    assert context_choices({"n_layers": 2, "n_embd": 64, "n_head": 4, "ctx": 5000}) == [5000, 4096]
    assert context_choices({"n_layers": 2, "n_embd": 64, "n_head": 4, "ctx": 131072}) == [131072, 65536, 32768, 16384, 8192, 4096]
    assert context_choices({"n_layers": 2, "n_embd": 64, "n_head": 4}) == []  # the header does not say: the engine's default
    assert context_choices({}) == []


def test_a_cpu_plan_sets_the_models_own_context(node, tiny_gguf):
    launch = plan_load(model_path=str(tiny_gguf), model_name="own").launch
    assert launch.backend == "llama-cpp-python"
    assert _flag(launch.argv, "--n_ctx") == "2048"  # its own default would be 2,048 whatever the model
    assert launch.context == 2048 and "context 2,048 tokens, the model's own" in launch.reason
    assert "KV cache 0.0 GiB for 2048 tokens" in launch.estimate_detail


def test_on_a_gpu_the_largest_context_that_fits_is_chosen_and_said(node, long_gguf):
    _gpu_node(node, free_mib=800)  # 512 MiB overhead + 1 MiB weights: 287 MiB left for the KV cache
    launch = plan_load(model_path=str(long_gguf), model_name="long").launch
    assert launch.backend == "llama-server" and launch.gpus == (0,)
    assert _flag(launch.argv, "--ctx-size") == str(MILLION // 2) and launch.context == MILLION // 2
    assert launch.estimate_mib <= 800 and f"for {MILLION // 2} tokens" in launch.estimate_detail
    assert "context 524,288 tokens of the model's 1,048,576: with all of them it needs ~1.0 GiB" in launch.reason
    assert "largest free is 0.8 GiB on gpu 0" in launch.reason


def test_a_gpu_with_room_for_the_whole_context_gets_it(node, long_gguf):
    _gpu_node(node, free_mib=2000)
    launch = plan_load(model_path=str(long_gguf), model_name="long").launch
    assert _flag(launch.argv, "--ctx-size") == str(MILLION)
    assert f"context {MILLION:,} tokens, the model's own" in launch.reason
    assert launch.estimate_mib == 512 + 512 + 1  # KV + overhead + the 0.6 MB file, rounded up


def test_a_gpu_without_room_for_the_least_context_refuses_with_the_numbers(node, long_gguf):
    from serving.models import ModelInstance

    _gpu_node(node, free_mib=400)
    with pytest.raises(LoadRefused) as refused:
        plan_load(model_path=str(long_gguf), model_name="long")
    assert refused.value.status == 409 and refused.value.code == "does_not_fit"
    assert "largest free is 0.4 GiB" in refused.value.message
    assert "with a context of 4,096 tokens, the least the console sets" in refused.value.message
    assert not ModelInstance.objects.exists()


def test_the_loads_own_context_wins_and_is_not_fitted(node, long_gguf):
    _gpu_node(node, free_mib=2000)
    launch = plan_load(model_path=str(long_gguf), model_name="long", extra_args={"--ctx-size": "8192"}).launch
    assert launch.argv.count("--ctx-size") == 1 and _flag(launch.argv, "--ctx-size") == "8192"
    assert launch.context == 8192 and "tokens, the model's own" not in launch.reason
    assert "for 8192 tokens" in launch.estimate_detail


def test_ram_bounds_the_context_on_a_cpu(node, long_gguf):
    from hardware.models import Node

    Node.objects.filter(pk=node.pk).update(memory_total_mib=64000, memory_used_mib=64000 - 700)
    launch = plan_load(model_path=str(long_gguf), model_name="long").launch
    assert launch.backend == "llama-cpp-python" and launch.gpus == ()
    assert _flag(launch.argv, "--n_ctx") == str(MILLION // 4)  # 128 MiB of KV: 641 MiB of 700 free
    assert "more than the 0.7 GiB free in RAM of node-t" in launch.reason
    # What the node offers to models (XGEN_NODE_MEMORY_MIB) bounds it as well.
    Node.objects.filter(pk=node.pk).update(memory_used_mib=0, model_memory_mib=600)
    launch = plan_load(model_path=str(long_gguf), model_name="long").launch
    assert _flag(launch.argv, "--n_ctx") == str(MILLION // 8)


@pytest.fixture
def store(settings, tmp_path):
    settings.STORE_DIR, settings.MINIO_ENDPOINT = tmp_path / "store", ""
    from hub.store import get_store

    return get_store()


def test_a_stored_models_header_is_read_from_the_store_once_per_file(node, long_gguf, tiny_gguf, store):
    from hub.index import index_prefix, refresh_index
    from hub.models import ModelArtifact

    set_backends(NODE, node_backends())  # llama-server built on this machine, on the CPU
    store.upload_model("gguf/long", long_gguf)
    index_prefix("gguf/long", store=store)  # indexing reads the header: a load does not wait on the store for it
    cached = ModelArtifact.objects.get(prefix="gguf/long").model_header
    assert cached["ctx"] == MILLION and cached["file"] == "long.gguf" and cached["etag"]
    launch = plan_load(model_path="gguf/long", model_name="long").launch
    # The estimate knows the KV cache of the whole context (not the store size + 15 %).
    assert launch.context == MILLION and f"KV cache 0.5 GiB for {MILLION} tokens" in launch.estimate_detail
    # A row indexed before the index kept headers: read at its first load, and kept.
    ModelArtifact.objects.filter(prefix="gguf/long").update(model_header={})
    assert plan_load(model_path="gguf/long", model_name="long").launch.context == MILLION
    assert ModelArtifact.objects.get(prefix="gguf/long").model_header == cached
    # The file replaced in the store (a 2,048-token model): the header read before stands while the
    # index names the old file; once the index has the new ETag, the new header is read.
    (store.root / "gguf" / "long" / "long.gguf").write_bytes(tiny_gguf.read_bytes())
    assert plan_load(model_path="gguf/long", model_name="long").launch.context == MILLION
    refresh_index(store=store)
    assert plan_load(model_path="gguf/long", model_name="long").launch.context == 2048
    assert ModelArtifact.objects.get(prefix="gguf/long").model_header["ctx"] == 2048
    # Not indexed yet: its manifest names the file, read from the store each time.
    store.upload_model("gguf/fresh", long_gguf)
    assert plan_load(model_path="gguf/fresh", model_name="fresh").launch.context == MILLION


async def test_llama_server_runs_with_the_context_the_plan_chose(agent, serving_settings, tmp_path):
    """The real llama-server, planned on a node that offers 516 MiB to models: the tiny model's 8,192
    trained tokens (517 MiB with overhead) do not fit, 4,096 (515 MiB) do, and the engine's log
    says it allocated that context (its own default would have been 8,192)."""
    from asgiref.sync import sync_to_async

    from hardware.models import Node
    from hub.demo import write_tiny_llama_gguf
    from serving.control.services import request_load
    from serving.models import InstanceState
    from serving.node.logs import current_log
    from tests.serving.conftest import wait_state

    serving_settings.NODE_MEMORY_MIB = 516  # what the agent says at its next heartbeat
    await sync_to_async(Node.objects.filter(name=NODE).update)(model_memory_mib=516)
    model = write_tiny_llama_gguf(tmp_path / "ctx8k.gguf", n_ctx=8192)
    inst = await sync_to_async(request_load)(model_path=str(model), model_name="ctx8k", backend="llama-server")
    agent.nudge()
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR}, timeout=90)
    assert inst.state == InstanceState.READY, inst.last_error
    assert inst.plan["context"] == 4096 and "--ctx-size" in inst.plan["argv"]
    assert "context 4,096 tokens of the model's 8,192" in inst.backend_reason
    log = current_log(inst.pk).read_text(errors="replace")
    assert "n_slots = 16, n_ctx_slot = 4096, kv_unified = 'true'" in log, log[-2000:]


# ------------------------------------------------------------------ vLLM's share of a GPU
VLLM = {"name": "vllm", "available": True, "version": "0.17.0", "flavour": "cuda", "path": "", "reason": ""}


@pytest.fixture
def hf_model(tmp_path) -> Path:
    import json

    folder = tmp_path / "hf"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
              "intermediate_size": 128, "max_position_embeddings": 512, "torch_dtype": "float16"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"x" * 64)
    return folder


def _vllm_node(node, used_mib: tuple[int, ...]):
    from hardware.models import GpuDevice

    node.backends = [VLLM]
    node.save()
    for index, used in enumerate(used_mib):
        GpuDevice.objects.create(node=node, index=index, vendor="NVIDIA", type="NVIDIA", name="L4",
                                 memory_total_mib=24000, memory_used_mib=used)


def test_vllm_gets_and_is_counted_for_its_share_of_the_gpu(node, hf_model):
    """vLLM holds --gpu-memory-utilization of each GPU (0.9 by default) whatever the model needs, and
    refuses to start with less free: the plan sets the share and counts it as the instance's memory."""
    _vllm_node(node, (600,))
    launch = plan_load(model_path=str(hf_model), model_name="hf").launch
    assert launch.backend == "vllm" and launch.gpus == (0,)
    assert _flag(launch.argv, "--gpu-memory-utilization") == "0.90"
    assert launch.estimate_mib == 21600  # 0.9 x 24,000 MiB, not the tiny model's ~0.5 GiB
    assert "vLLM takes 0.90 of each GPU's memory at start" in launch.estimate_detail
    assert "the model needs ~0.5 GiB of it" in launch.estimate_detail and "vllm takes 0.90 of each" in launch.fit


def test_vllm_on_a_gpu_that_another_model_uses_gets_what_is_free(node, hf_model):
    _vllm_node(node, (10000,))  # 14,000 of 24,000 MiB free: 0.58 of it
    launch = plan_load(model_path=str(hf_model), model_name="hf").launch
    assert _flag(launch.argv, "--gpu-memory-utilization") == "0.58" and launch.estimate_mib == 13920
    assert "vLLM's own 0.9 would not start: 0.58 is free" in launch.estimate_detail


def test_vllm_share_on_two_gpus_is_the_least_free_one(node, hf_model):
    _vllm_node(node, (600, 12000))
    launch = plan_load(model_path=str(hf_model), model_name="hf", tensor_parallel_size=2).launch
    assert launch.gpus == (0, 1) and _flag(launch.argv, "--gpu-memory-utilization") == "0.50"
    assert launch.estimate_mib == 24000  # 0.5 of each


def test_the_loads_own_share_is_checked_against_what_is_free(node, hf_model):
    from serving.models import ModelInstance

    _vllm_node(node, (10000,))
    launch = plan_load(model_path=str(hf_model), model_name="hf", extra_args={"--gpu-memory-utilization": 0.5}).launch
    assert launch.argv.count("--gpu-memory-utilization") == 1 and _flag(launch.argv, "--gpu-memory-utilization") == "0.5"
    assert launch.estimate_mib == 12000 and "as the load sets" in launch.estimate_detail
    with pytest.raises(LoadRefused) as refused:
        plan_load(model_path=str(hf_model), model_name="hf", extra_args={"--gpu-memory-utilization": 0.9})
    assert refused.value.status == 409 and refused.value.code == "does_not_fit"
    assert "21.1 GiB of GPU 0 of node-t, which has 13.7 GiB free" in refused.value.message
    assert not ModelInstance.objects.exists()


def test_a_second_vllm_model_gets_what_the_first_left(client, node, operator, hf_model):
    """Two loads through the API on one 24,000 MiB GPU, the detector not having seen the first
    allocate yet: the first is counted at its 0.9 share, so the second gets the 0.07 left (vLLM's
    default 0.9 would not start), and a third finds too little for the model."""
    from tests.conftest import bearer

    def load(name: str, **extra):
        return client.post("/api/management/load", {"model_path": str(hf_model), "model_name": name, **extra},
                           content_type="application/json", **bearer(operator.key))

    def share(response) -> str:
        one = client.get(f"/api/management/instances/{response.json()['id']}", **bearer(operator.key)).json()
        return _flag(one["command"], "--gpu-memory-utilization")

    _vllm_node(node, (600,))
    first = load("a")
    assert first.status_code == 202 and share(first) == "0.90", first.content
    second = load("b")
    assert second.status_code == 202 and share(second) == "0.07", second.content  # 1,800 MiB of 24,000 free
    third = load("c")
    assert third.status_code == 409 and third.json()["error"]["code"] == "does_not_fit", third.content


def _hf_folder(path: Path, max_positions: int) -> Path:
    import json

    path.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
              "intermediate_size": 128, "max_position_embeddings": max_positions, "torch_dtype": "float16"}
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"x" * 64)
    return path


def test_vllm_gets_a_smaller_context_only_where_its_own_does_not_fit(node, tmp_path):
    """vLLM's own context is the model's (and it refuses to start when one sequence of it does not
    fit its KV cache): the plan passes --max-model-len only for a smaller one, with a share that
    holds it. The folder's KV cache is 512 bytes a token, as the tiny GGUF's."""
    long = _hf_folder(tmp_path / "long", MILLION)
    _vllm_node(node, (24000 - 800,))  # 800 MiB free: 512 MiB overhead + 256 MiB for 524,288 tokens
    launch = plan_load(model_path=str(long), model_name="long").launch
    assert _flag(launch.argv, "--max-model-len") == str(MILLION // 2) and launch.context == MILLION // 2
    assert "context 524,288 tokens of the model's 1,048,576" in launch.reason
    # The share: the least free fraction in thousandths that holds the 768 MiB (0.04 of 24,000 would not fit).
    assert _flag(launch.argv, "--gpu-memory-utilization") == "0.033" and launch.estimate_mib == 792
    short = _hf_folder(tmp_path / "short", 4096)
    launch = plan_load(model_path=str(short), model_name="short").launch
    assert "--max-model-len" not in launch.argv and launch.context == 4096  # its own: vLLM's default
    assert "tokens, the model's own" not in launch.reason


def test_a_stored_hugging_face_models_config_sizes_it(node, tmp_path, store):
    """The index keeps what sizes a stored folder (its config.json, read once), so vLLM's plan for
    it counts weights and KV cache from the config, not the store size + 15 %, and chooses its context."""
    from hub.index import index_prefix
    from hub.models import ModelArtifact

    store.upload_model("huggingface/long", _hf_folder(tmp_path / "long", MILLION))
    index_prefix("huggingface/long", store=store)
    header = ModelArtifact.objects.get(prefix="huggingface/long").model_header
    assert (header["ctx"], header["n_layers"], header["file"]) == (MILLION, 2, "config.json")
    assert header["config"]["torch_dtype"] == "float16" and header["etag"]
    _vllm_node(node, (24000 - 800,))
    launch = plan_load(model_path="huggingface/long", model_name="long").launch
    assert _flag(launch.argv, "--max-model-len") == str(MILLION // 2)
    assert f"B params x 2 bytes = 0.0 GiB + KV cache 0.2 GiB for {MILLION // 2} tokens" in launch.estimate_detail
