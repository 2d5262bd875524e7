"""vLLM's OpenAI server (CUDA and ROCm builds) for Hugging Face / safetensors models."""
from __future__ import annotations

import sys

from django.conf import settings

from serving.adapters.base import (
    BOOL,
    FLOAT,
    INT,
    STR,
    TEMPLATE,
    BackendAdapter,
    InvalidExtraArgs,
    LaunchSpec,
    parse_version,
    share_text,
)

# vLLM's docs: through 0.10.0 embeddings use `--task embed` (rerankers `--task score`); from 0.10.1
# `--runner pooling --convert embed` (a cross-encoder: `--runner pooling`, its classification head is found).
POOLING_RUNNER_SINCE = (0, 10, 1)
# Held against vLLM itself (tests/serving/test_vllm_help.py, recordings of 0.15.1, 0.17.0, 0.33.0;
# the boundaries read from the 0.16.0, 0.17.1 and 0.18.0 wheels): `--convert reward` went in 0.16.0,
# `--swap-space` in 0.18.0.
CONVERT_REWARD_UNTIL = (0, 16, 0)
SWAP_SPACE_UNTIL = (0, 18, 0)
RESPONSES_SINCE = (0, 10, 0)
MESSAGES_SINCE = (0, 12, 0)
# Its count_tokens only from 0.17.0 (absent in the 0.15.1 and 0.16.0 wheels: tests/serving/vllm_routes).
COUNT_TOKENS_SINCE = (0, 17, 0)
# /v1/load_lora_adapter and /v1/unload_lora_adapter (with VLLM_ALLOW_RUNTIME_LORA_UPDATING) came
# in vLLM 0.6.2 (September 2024); every recorded route table (tests/serving/vllm_routes) has them.
RUNTIME_LORA_SINCE = (0, 6, 2)

COMMON_FLAGS = {
    "--max-model-len": INT,
    "--gpu-memory-utilization": FLOAT,
    "--dtype": "choice:auto|half|float16|bfloat16|float|float32",
    "--max-num-seqs": INT,
    "--max-num-batched-tokens": INT,
    "--enforce-eager": BOOL,
    "--trust-remote-code": BOOL,  # only with XGEN_ALLOW_TRUST_REMOTE_CODE=true (see _check_value)
    "--quantization": STR,
    "--kv-cache-dtype": STR,
    "--block-size": INT,
    "--seed": INT,
    "--enable-prefix-caching": BOOL,
    "--enable-chunked-prefill": BOOL,
    "--pipeline-parallel-size": INT,
    "--chat-template": TEMPLATE,
    "--tokenizer-mode": STR,
    "--revision": STR,
    # Engine presets (issue 27 #3): tool calls, reasoning and speculative decoding (in every recorded --help).
    "--enable-auto-tool-choice": BOOL,
    "--tool-call-parser": STR,
    "--reasoning-parser": STR,
    "--speculative-config": STR,
    # LoRA without adapters at load, so that adapters can be added at runtime (issue 27 #1).
    "--enable-lora": BOOL,
    "--max-loras": INT,
    "--max-lora-rank": INT,
}


def uses_pooling_runner(version: str) -> bool:
    """True when this vLLM takes `--runner pooling --convert embed` (unknown version: the current style)."""
    parsed = parse_version(version)
    return not parsed or parsed >= POOLING_RUNNER_SINCE


class VllmServer(BackendAdapter):
    name = "vllm"
    label = "vLLM"
    formats = ("huggingface",)
    health_path = "/health"
    busy_path = "/metrics"  # Prometheus text: vllm:num_requests_running and _waiting
    ready_hints = ("Uvicorn running on", "Application startup complete")
    inference_routes = BackendAdapter.inference_routes | {
        "/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/rerank", "/v1/score",
        "/v1/audio/transcriptions", "/v1/audio/translations",
        "/tokenize", "/detokenize", "/rerank", "/score", "/pooling", "/classify",
    }
    server_types = frozenset({"llm", "embedding", "rerank"})
    supports_adapters = True  # --enable-lora --lora-modules at start
    # Its weights, then a KV cache that fills the rest of this share of each GPU (default 0.9); it
    # refuses to start while less than that share is free ("Free memory on device ... is less than
    # desired GPU memory utilization").
    gpu_share_flag = "--gpu-memory-utilization"
    # Its default is the model's own context (max_position_embeddings, or more with rope scaling), and
    # it refuses to start when one sequence of it does not fit its KV cache ("... larger than the
    # maximum number of tokens that can be stored in KV cache"): the plan sets a smaller one then.
    context_flag = "--max-model-len"
    context_only_smaller = True

    def serves(self, path: str, version: str = "") -> bool:
        """/v1/responses since 0.10; Anthropic's /v1/messages in the OpenAI server only in recent
        versions, so without a known version >= 0.12 the proxy translates it to chat completions."""
        parsed = parse_version(version)
        if path == "/v1/responses":
            return not parsed or parsed >= RESPONSES_SINCE
        if path == "/v1/messages/count_tokens":
            return bool(parsed) and parsed >= COUNT_TOKENS_SINCE
        if path.startswith("/v1/messages"):
            return bool(parsed) and parsed >= MESSAGES_SINCE
        return super().serves(path, version)

    def load_timeout_s(self) -> int:
        return settings.LOAD_TIMEOUT_VLLM_S

    def requests_in_flight(self, body: bytes) -> int | None:
        """Running plus waiting requests, summed over the metrics' label sets."""
        total, seen = 0.0, False
        for line in body.decode(errors="replace").splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                try:
                    total += float(line.rsplit(" ", 1)[1])
                except (IndexError, ValueError):
                    return None
                seen = True
        return int(total) if seen else None

    def allowed_flags(self, version: str) -> dict[str, str]:
        flags = dict(COMMON_FLAGS)
        parsed = parse_version(version)
        if parsed and parsed < SWAP_SPACE_UNTIL:  # an unknown version is taken as a current one
            flags["--swap-space"] = FLOAT
        if uses_pooling_runner(version):
            flags["--runner"] = "choice:auto|generate|pooling"
            flags["--convert"] = "choice:auto|none|embed|classify" + (
                "|reward" if parsed and parsed < CONVERT_REWARD_UNTIL else "")
        else:
            flags["--task"] = "choice:auto|generate|embed|classify|score|reward"
        return flags

    def _check_value(self, flag: str, kind: str, value: object) -> object:
        checked = super()._check_value(flag, kind, value)
        if flag == "--trust-remote-code" and checked is True and not settings.ALLOW_TRUST_REMOTE_CODE:
            # Remote code is Python from the model's repository, run inside the backend.
            raise InvalidExtraArgs("--trust-remote-code runs the model repository's own Python code; this console "
                                   "refuses it unless XGEN_ALLOW_TRUST_REMOTE_CODE=true")
        return checked

    def runtime_adapters(self, version: str) -> bool:
        """/v1/load_lora_adapter and /v1/unload_lora_adapter (an unknown version: a current one)."""
        parsed = parse_version(version)
        return not parsed or parsed >= RUNTIME_LORA_SINCE

    def env_additions(self, spec: LaunchSpec) -> dict[str, str]:
        env = super().env_additions(spec)
        if spec.adapters or spec.extra_args.get("--enable-lora") is True:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # adapters added and removed while it runs
        return env

    def key_env(self, secret: str) -> dict[str, str]:
        # The OpenAI server takes --api-key or VLLM_API_KEY; the flag would show in `ps` and in
        # its "non-default args" log line.
        return {"VLLM_API_KEY": secret}

    def serving_defaults(self, spec: LaunchSpec) -> tuple[list[str], str]:
        """A context smaller than the model's where the whole one does not fit (context_argv)."""
        return self.context_argv(spec)

    def build_command(self, spec: LaunchSpec) -> list[str]:
        cmd = [
            spec.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(spec.model_file),
            "--served-model-name", spec.model_name,
            "--host", spec.host,
            "--port", str(spec.port),
        ]
        if spec.is_embedding:
            if uses_pooling_runner(spec.version):
                cmd += ["--runner", "pooling", "--convert", "embed"]
            else:
                cmd += ["--task", "embed"]
        elif spec.is_rerank:
            cmd += ["--runner", "pooling"] if uses_pooling_runner(spec.version) else ["--task", "score"]
        if len(spec.gpus) > 1 or spec.tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(max(spec.tensor_parallel_size, len(spec.gpus)))]
        if spec.adapters:  # each served as <model>:<name>, the name a request gives as `model`
            cmd += ["--enable-lora", "--lora-modules",
                    *(f"{spec.model_name}:{name}={path}" for name, path, _ in spec.adapters)]
        cmd += self.serving_defaults(spec)[0]
        extra = self.extra_argv(spec)
        if spec.gpu_share and self.gpu_share_flag not in extra:
            cmd += [self.gpu_share_flag, share_text(spec.gpu_share)]
        if spec.adapters:
            extra = _drop_flags(extra, {"--enable-lora"})  # given above already
        if spec.is_embedding:
            # The adapter already chose the runner; a second one would contradict it.
            extra = _drop_flags(extra, {"--runner", "--convert", "--task"})
        elif spec.is_rerank:  # `--convert classify` stays: a causal LM made a cross-encoder (Qwen3-Reranker)
            extra = _drop_flags(extra, {"--runner", "--task"})
        return cmd + extra


def _drop_flags(argv: list[str], flags: set[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for i, item in enumerate(argv):
        if skip:
            skip = False
            continue
        if item in flags:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(item)
    return out
