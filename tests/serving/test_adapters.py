"""Command lines, flags and environments of each backend adapter, across versions."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from serving.adapters import ADAPTERS, InvalidExtraArgs, LaunchSpec, get_adapter
from serving.adapters.base import parse_version
from serving.adapters.vllm import uses_pooling_runner

MODEL_DIR = Path("/models/huggingface/Qwen_Qwen3-4B")
GGUF = Path("/models/gguf/tiny/tiny.gguf")


def spec(**kw) -> LaunchSpec:
    base = dict(model_file=MODEL_DIR, model_name="qwen", server_type="llm", host="127.0.0.1", port=18001)
    base.update(kw)
    return LaunchSpec(**base)


def test_registry_is_explicit():
    assert set(ADAPTERS) == {"vllm", "llama-server", "llama-cpp-python"}
    with pytest.raises(KeyError):
        get_adapter("tgi")


@pytest.mark.parametrize("version,parsed", [
    ("0.9.2", (0, 9, 2)), ("0.10.0", (0, 10, 0)), ("0.10.1", (0, 10, 1)), ("0.10.1rc1", (0, 10, 1)),
    ("0.15.1+cu128", (0, 15, 1)), ("v0.17.0", (0, 17, 0)), ("0.33.0", (0, 33, 0)), ("b6123", (6123,)), ("", ()),
])
def test_versions_parse(version, parsed):
    assert parse_version(version) == parsed


# vLLM's docs: `--task embed` through 0.10.0, `--runner pooling --convert embed` from 0.10.1.
@pytest.mark.parametrize("version,embed_flags", [
    ("0.9.2", ["--task", "embed"]),
    ("0.10.0", ["--task", "embed"]),
    ("0.10.1", ["--runner", "pooling", "--convert", "embed"]),
    ("0.15.1", ["--runner", "pooling", "--convert", "embed"]),
    ("0.17.0", ["--runner", "pooling", "--convert", "embed"]),
    ("0.33.0", ["--runner", "pooling", "--convert", "embed"]),
])
def test_vllm_embedding_flags_follow_the_installed_version(version, embed_flags):
    vllm = get_adapter("vllm")
    cmd = vllm.build_command(spec(server_type="embedding", version=version))
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[3:11] == ["--model", str(MODEL_DIR), "--served-model-name", "qwen", "--host", "127.0.0.1",
                         "--port", "18001"]
    assert cmd[11:] == embed_flags
    llm = vllm.build_command(spec(version=version))
    assert not {"--task", "--runner", "--convert"} & set(llm)
    assert uses_pooling_runner(version) == (embed_flags[0] == "--runner")


@pytest.mark.parametrize("version", ["0.15.1", "0.17.0", "0.33.0"])
def test_vllm_tensor_parallel_env_and_extra_args(version):
    vllm = get_adapter("vllm")
    s = spec(version=version, gpus=(2, 3), gpu_type="NVIDIA", flavour="cuda", tensor_parallel_size=2,
             extra_args={"--max-model-len": "8192", "--enforce-eager": True, "--trust-remote-code": False,
                         "gpu-memory-utilization": 0.85})
    cmd = vllm.build_command(s)
    i = cmd.index("--tensor-parallel-size")
    assert cmd[i + 1] == "2"
    assert cmd[cmd.index("--max-model-len") + 1] == "8192"
    assert "--enforce-eager" in cmd and "--trust-remote-code" not in cmd
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.85"
    env = vllm.build_env(s, {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1" and env["PATH"] == "/usr/bin"
    amd = vllm.build_env(spec(version=version, gpus=(1,), gpu_type="AMD_CDNA", flavour="rocm"), {})
    assert amd["HIP_VISIBLE_DEVICES"] == "1" and "CUDA_VISIBLE_DEVICES" not in amd
    one_gpu = vllm.build_command(spec(version=version, gpus=(0,), gpu_type="NVIDIA"))
    assert "--tensor-parallel-size" not in one_gpu


def test_vllm_runner_flags_are_allowed_only_where_the_version_has_them():
    vllm = get_adapter("vllm")
    assert vllm.normalize_extra_args({"--task": "generate"}, "0.10.0") == {"--task": "generate"}
    with pytest.raises(InvalidExtraArgs, match="--task"):
        vllm.normalize_extra_args({"--task": "generate"}, "0.17.0")
    with pytest.raises(InvalidExtraArgs, match="--runner"):
        vllm.normalize_extra_args({"--runner": "pooling"}, "0.9.2")
    assert vllm.normalize_extra_args({"--runner": "generate"}, "0.15.1") == {"--runner": "generate"}
    # An embedding instance keeps the adapter's own runner choice.
    cmd = vllm.build_command(spec(server_type="embedding", version="0.17.0", extra_args={"--convert": "classify"}))
    assert cmd.count("--convert") == 1 and cmd[cmd.index("--convert") + 1] == "embed"


@pytest.mark.parametrize("flavour,gpu_type,env_key", [
    ("cuda", "NVIDIA", "CUDA_VISIBLE_DEVICES"), ("rocm", "AMD_CDNA", "HIP_VISIBLE_DEVICES"),
    ("vulkan", "AMD_RDNA", "GGML_VK_VISIBLE_DEVICES"),
])
def test_llama_server_gpu_builds(flavour, gpu_type, env_key):
    ls = get_adapter("llama-server")
    s = spec(model_file=GGUF, model_name="tiny", gpus=(0, 1), gpu_type=gpu_type, flavour=flavour, version="b6500",
             executable="/opt/llama/bin/llama-server")
    cmd = ls.build_command(s)
    assert cmd[:9] == ["/opt/llama/bin/llama-server", "-m", str(GGUF), "--alias", "tiny", "--host", "127.0.0.1",
                       "--port", "18001"]
    assert cmd[cmd.index("-ngl") + 1] == "999"
    assert ls.build_env(s, {})[env_key] == "0,1"
    assert ls.health_path == "/health"


def test_llama_server_embedding_cpu_and_flags_by_build():
    ls = get_adapter("llama-server")
    cmd = ls.build_command(spec(model_file=GGUF, model_name="emb", server_type="embedding", flavour="cpu"))
    assert cmd[0] == "llama-server" and "--embeddings" in cmd and cmd[cmd.index("--pooling") + 1] == "mean"
    assert "-ngl" not in cmd
    # --flash-attn: a bare switch on old builds, on|off|auto from b6325.
    assert ls.normalize_extra_args({"--flash-attn": True}, "b5000") == {"--flash-attn": True}
    assert ls.normalize_extra_args({"--flash-attn": "on"}, "b6500") == {"--flash-attn": "on"}
    with pytest.raises(InvalidExtraArgs, match="--flash-attn needs a value"):
        ls.normalize_extra_args({"--flash-attn": True}, "b6500")
    # --cache-ram (the host-memory prompt cache, MiB) from about b6700; the builds here say 0.5.0 (build 0)
    assert ls.normalize_extra_args({"--cache-ram": 0}, "0.5.0-dev (build 0, commit 0c1e570)") == {"--cache-ram": 0}
    assert ls.normalize_extra_args({"--cache-ram": 1024}, "b6800") == {"--cache-ram": 1024}
    with pytest.raises(InvalidExtraArgs, match="--cache-ram"):
        ls.normalize_extra_args({"--cache-ram": 0}, "b6500")
    cmd = ls.build_command(spec(model_file=GGUF, model_name="t", gpus=(0,), gpu_type="NVIDIA", flavour="cuda",
                                extra_args={"--n-gpu-layers": 20, "--ctx-size": 4096}))
    assert "-ngl" not in cmd and cmd[cmd.index("--n-gpu-layers") + 1] == "20"


def test_llama_server_serves_many_users_by_default():
    """Issue 28 #2: a chat model gets 16 slots over one unified KV cache; a load or preset that sets
    the slots or the KV layout keeps its own; embedding and rerank models and old builds get none."""
    ls = get_adapter("llama-server")
    cmd = ls.build_command(spec(model_file=GGUF, model_name="t", flavour="cpu", version="b6500"))
    assert cmd[cmd.index("--parallel") + 1] == "16" and "--kv-unified" in cmd
    assert "16 slots" in ls.serving_defaults(spec(model_file=GGUF, model_name="t", version="b6500"))[1]
    for extra in ({"--parallel": 2}, {"--no-kv-unified": True}, {"--kv-unified": True, "--parallel": 4}):
        cmd = ls.build_command(spec(model_file=GGUF, model_name="t", version="b6500", extra_args=extra))
        assert cmd.count("--parallel") == ("--parallel" in extra), cmd
        assert cmd.count("--kv-unified") == ("--kv-unified" in extra), cmd
    for server_type in ("embedding", "rerank"):
        cmd = ls.build_command(spec(model_file=GGUF, model_name="e", server_type=server_type, version="b6500"))
        assert "--parallel" not in cmd and "--kv-unified" not in cmd
    old = ls.build_command(spec(model_file=GGUF, model_name="t", version="b6000"))
    assert "--parallel" not in old and "--kv-unified" not in old
    with pytest.raises(InvalidExtraArgs, match="--kv-unified"):
        ls.normalize_extra_args({"--kv-unified": True}, "b6000")
    assert get_adapter("llama-cpp-python").serving_defaults(spec(model_file=GGUF, model_name="t")) == ([], "")


def test_a_shared_cpu_gives_each_backend_its_share_of_the_cores():
    """Issue 28 #2: a backend alone on the CPU, or on GPUs, keeps the engine's own threads (every
    core); one that shares the CPU with other llama.cpp backends gets cores // backends (>= 1)."""
    ls, lcp = get_adapter("llama-server"), get_adapter("llama-cpp-python")
    alone = spec(model_file=GGUF, model_name="t", version="b6500", cpu_cores=8, cpu_backends=1)
    assert "--threads" not in ls.build_command(alone) and "--n_threads" not in lcp.build_command(alone)
    shared = spec(model_file=GGUF, model_name="t", version="b6500", cpu_cores=8, cpu_backends=3)
    cmd = ls.build_command(shared)
    assert cmd[cmd.index("--threads") + 1] == "2" and "--threads-batch" not in cmd
    assert "2 threads: its share of the node's 8 cores with 2 other llama.cpp backends on the CPU" in \
        ls.serving_defaults(shared)[1] and "16 slots" in ls.serving_defaults(shared)[1]
    cmd = lcp.build_command(shared)
    assert cmd[cmd.index("--n_threads") + 1] == "2" and cmd[cmd.index("--n_threads_batch") + 1] == "2"
    crowded = spec(model_file=GGUF, model_name="t", cpu_cores=2, cpu_backends=5)
    assert "1 thread: its share" in lcp.serving_defaults(crowded)[1]
    on_gpu = spec(model_file=GGUF, model_name="t", cpu_cores=8, cpu_backends=3, gpus=(0,), gpu_type="NVIDIA",
                  flavour="cuda")
    assert "--threads" not in ls.build_command(on_gpu) and "--n_threads" not in lcp.build_command(on_gpu)
    given = spec(model_file=GGUF, model_name="t", cpu_cores=8, cpu_backends=3, extra_args={"--threads-batch": 6})
    assert "--threads" not in ls.build_command(given)  # the load's own threads stand
    given = spec(model_file=GGUF, model_name="t", cpu_cores=8, cpu_backends=3, extra_args={"--n_threads": 6})
    cmd = lcp.build_command(given)
    assert cmd.count("--n_threads") == 1 and cmd[cmd.index("--n_threads") + 1] == "6" and "--n_threads_batch" not in cmd


def test_llama_cpp_python_command():
    lcp = get_adapter("llama-cpp-python")
    cmd = lcp.build_command(spec(model_file=GGUF, model_name="tiny", server_type="embedding",
                                 extra_args={"--n_ctx": 512, "--verbose": False}))
    assert cmd[:3] == [sys.executable, "-m", "llama_cpp.server"]
    assert cmd[3:11] == ["--model", str(GGUF), "--model_alias", "tiny", "--host", "127.0.0.1", "--port", "18001"]
    assert cmd[11:13] == ["--embedding", "true"]
    assert cmd[cmd.index("--n_ctx") + 1] == "512" and cmd[cmd.index("--verbose") + 1] == "false"
    assert lcp.health_path == "/v1/models"
    assert lcp.warmup_request(spec(server_type="embedding"))[0] == "/v1/embeddings"
    path, body = lcp.warmup_request(spec())
    assert path == "/v1/chat/completions" and body["max_tokens"] == 1


@pytest.mark.parametrize("backend,extra,match", [
    ("llama-cpp-python", {"--model": "/etc/passwd"}, "--model"),
    ("llama-cpp-python", {"--host": "0.0.0.0"}, "--host"),
    ("vllm", {"--port": "1"}, "--port"),
    ("vllm", {"--max-model-len": "8192\n--evil"}, "newline"),
    ("vllm", {"--max-model-len": "x" * 600}, "too long"),
    ("vllm", {"--max-model-len": "lots"}, "whole number"),
    ("vllm", {"--max-model-len; rm -rf /": "1"}, "not a flag"),
    ("llama-server", {"--ctx-size": True}, "not true/false"),
    ("llama-server", {"--no-such-flag": "1"}, "--no-such-flag"),
    ("llama-server", {"--chat-template": "a\0b"}, "NUL"),
])
def test_bad_extra_args_are_refused_naming_the_flag(backend, extra, match):
    with pytest.raises(InvalidExtraArgs, match=match):
        get_adapter(backend).normalize_extra_args(extra, "0.17.0" if backend == "vllm" else "")


def test_extra_args_are_argv_items_never_a_shell():
    cmd = get_adapter("llama-server").build_command(
        spec(model_file=GGUF, model_name="t", extra_args={"--chat-template": "{{ x }} $(reboot); `id`"}))
    assert cmd[-2:] == ["--chat-template", "{{ x }} $(reboot); `id`"]


# Issue 17 #9: vLLM would run the model repository's own code on request.
def test_trust_remote_code_is_refused_unless_the_console_allows_it(settings):
    vllm = get_adapter("vllm")
    settings.ALLOW_TRUST_REMOTE_CODE = False
    with pytest.raises(InvalidExtraArgs, match="XGEN_ALLOW_TRUST_REMOTE_CODE"):
        vllm.normalize_extra_args({"--trust-remote-code": True}, "0.17.0")
    with pytest.raises(InvalidExtraArgs, match="XGEN_ALLOW_TRUST_REMOTE_CODE"):
        vllm.normalize_extra_args({"trust-remote-code": "true"}, "0.17.0")
    assert vllm.normalize_extra_args({"--trust-remote-code": False}, "0.17.0") == {}
    settings.ALLOW_TRUST_REMOTE_CODE = True
    assert vllm.normalize_extra_args({"--trust-remote-code": True}, "0.17.0") == {"--trust-remote-code": True}


def test_the_environment_is_an_allowlist_of_the_agents(settings):
    settings.BACKEND_ENV_PASS = ["VLLM_ATTENTION_BACKEND"]
    agent_env = {"PATH": "/usr/bin", "HOME": "/home/x", "LANG": "C.UTF-8", "LC_ALL": "C", "TMPDIR": "/tmp/x",
                 "LD_LIBRARY_PATH": "/opt/rocm/lib", "HF_HOME": "/data/hf", "CUDA_CACHE_PATH": "/c",
                 "HSA_OVERRIDE_GFX_VERSION": "11.0.0", "VLLM_ATTENTION_BACKEND": "FLASH_ATTN",
                 "XGEN_SECRET_KEY": "s", "DATABASE_URL": "postgres://u:p@h/d", "MINIO_SECRET_KEY": "m",
                 "XGEN_ADMIN_PASSWORD": "a", "REDIS_URL": "redis://h", "HF_TOKEN": "t", "DJANGO_SETTINGS_MODULE": "x",
                 "HF_HUB_OFFLINE": "0"}
    s = spec(gpus=(1,), gpu_type="NVIDIA", flavour="cuda", version="0.17.0")
    env = get_adapter("vllm").build_env(s, agent_env)
    assert env == {"PATH": "/usr/bin", "HOME": "/home/x", "LANG": "C.UTF-8", "LC_ALL": "C", "TMPDIR": "/tmp/x",
                   "LD_LIBRARY_PATH": "/opt/rocm/lib", "HF_HOME": "/data/hf", "CUDA_CACHE_PATH": "/c",
                   "HSA_OVERRIDE_GFX_VERSION": "11.0.0", "VLLM_ATTENTION_BACKEND": "FLASH_ATTN",
                   "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "1"}


@pytest.mark.parametrize("backend", ["vllm", "llama-server"])
@pytest.mark.parametrize("value", ["/etc/passwd", "../../data/secret_key", "~/x.jinja", "sub/dir.jinja"])
def test_a_chat_template_may_not_name_a_file(backend, value):
    from serving.adapters import InvalidExtraArgs, get_adapter

    with pytest.raises(InvalidExtraArgs, match="not a file path"):
        get_adapter(backend).normalize_extra_args({"--chat-template": value}, "")


@pytest.mark.parametrize("backend", ["vllm", "llama-server"])
@pytest.mark.parametrize("value", ["chatml", "{% for m in messages %}{{ m.content }}{% endfor %}"])
def test_a_chat_template_inline_or_by_name_is_kept(backend, value):
    from serving.adapters import get_adapter

    assert get_adapter(backend).normalize_extra_args({"--chat-template": value}, "") == {"--chat-template": value}


def test_each_backend_requires_the_instance_secret_never_seen_in_its_argv():
    """llama-server reads it from a file named in argv, llama-cpp-python and vLLM from their
    environment (their argv shows in `ps`, vLLM logs its non-default args)."""
    secret = "s3cr3t-" + "k" * 40
    server = get_adapter("llama-server")
    argv = server.build_command(spec(model_file=GGUF, api_key_file="/data/run/instances/7/api-key"))
    assert argv[argv.index("--api-key-file") + 1] == "/data/run/instances/7/api-key"
    assert "--api-key-file" not in server.build_command(spec(model_file=GGUF)), "no file named, no flag"
    assert server.key_env(secret) == {}
    assert get_adapter("llama-cpp-python").key_env(secret) == {"API_KEY": secret}
    assert get_adapter("vllm").key_env(secret) == {"VLLM_API_KEY": secret}
    for name, adapter in ADAPTERS.items():
        argv = adapter.build_command(spec(model_file=GGUF if name != "vllm" else MODEL_DIR, api_key_file="/k"))
        assert secret not in " ".join(argv)
        assert not {"--api-key", "--api_key", "--api-key-file"} & set(adapter.allowed_flags("")), \
            f"{name}: no extra argument may set or replace the secret"


def test_llama_cpp_python_answers_concurrent_chats_each_in_full(tiny_gguf, tmp_path):
    """With the adapter's argv, requests wait their turn: llama-cpp-python's own default
    (interrupt_requests true) ended the answer being streamed whenever another request came, and
    3 of 4 concurrent chats came back 200 with a role chunk and [DONE], no text."""
    import asyncio
    import json
    import os
    import subprocess

    import httpx

    from tests.procs import free_port, stop_process, wait_http

    lcp = get_adapter("llama-cpp-python")
    launch = spec(model_file=tiny_gguf, model_name="tiny", port=free_port())
    cmd = lcp.build_command(launch)
    assert cmd[cmd.index("--interrupt_requests") + 1] == "false"
    overridden = lcp.build_command(spec(extra_args={"--interrupt_requests": True}))
    assert overridden.count("--interrupt_requests") == 1 and overridden[overridden.index("--interrupt_requests") + 1] == "true"
    with open(tmp_path / "engine.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=lcp.build_env(launch, dict(os.environ)))
    try:
        wait_http(f"http://127.0.0.1:{launch.port}/v1/models", proc=proc, timeout=60)

        async def chat(client: httpx.AsyncClient) -> str:
            body = {"model": "tiny", "stream": True, "max_tokens": 16, "temperature": 0,
                    "messages": [{"role": "user", "content": "hello"}]}
            text = ""
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            return text

        async def four() -> list[str]:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{launch.port}", timeout=120) as client:
                return await asyncio.gather(*(chat(client) for _ in range(4)))

        answers = asyncio.run(four())
        assert all(answers) and len(set(answers)) == 1, answers  # temperature 0: the same text, four times
    finally:
        stop_process(proc)
