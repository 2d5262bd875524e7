"""llama.cpp's `llama-server` (CUDA, ROCm, Vulkan and CPU builds) for GGUF files."""
from __future__ import annotations

import json

from django.conf import settings

from serving.adapters.base import BOOL, FLOAT, INT, STR, TEMPLATE, BackendAdapter, LaunchSpec, parse_version

# From build b6325 (2025-08) `--flash-attn` takes on|off|auto; before it was a bare switch.
FLASH_ATTN_VALUE_SINCE = 6325
# From about build b6700 (2025-10, llama.cpp PR 16391) prompts are also cached in host memory,
# `--cache-ram` MiB of it (default 8192, -1 no limit, 0 off): bounding it bounds the node's memory.
CACHE_RAM_SINCE = 6700
# `--reasoning-format none|deepseek` (thoughts kept in the text, or split into reasoning_content) came
# with llama.cpp PR 11607 (February 2025, about build b4800; `auto`, the default now, later).
REASONING_FORMAT_SINCE = 4800
# `--kv-unified` (one KV buffer that every slot draws on) came with llama.cpp PR 14363 (mid 2025);
# b6500 is the oldest build the console states it for. With auto slots (`-np -1`, 4 of them) it is
# on by itself; an explicit `--parallel N` without it splits the context N ways.
KV_UNIFIED_SINCE = 6500
# The console's slots for a chat model (issue 28 #2): 16 streamed chats at once on the demo model,
# 2 cores, by hand (bench/concurrency.py, 2 rounds): 145 tokens/s with 16 slots, 150 with 8, 138
# with llama-server's own 4, TTFT p50 2.4 s with 16 against 5.3 s with 4 or 8; one chat alone is
# as fast. Throughput is within noise from 4 slots up; the wait of the chats past the slots is not.
DEFAULT_SLOTS = 16


def predates(version: str, build: int) -> bool:
    """Whether `version` (as the probe reports it) is known to be a llama.cpp build older than
    `build`: only an old-style build number below it. The semantic versions ("0.5.0 (build N,
    commit C)") came long after b6325, and build 0 is llama.cpp's "unknown" (a build from a source
    package without git history, as deploy/build_llama_cpp.sh makes): both count as current."""
    parsed = parse_version(version)
    return len(parsed) == 1 and 0 < parsed[0] < build

COMMON_FLAGS = {
    "--ctx-size": INT,
    "--threads": INT,
    "--threads-batch": INT,
    "--batch-size": INT,
    "--ubatch-size": INT,
    "--parallel": INT,
    "--n-predict": INT,
    "--cont-batching": BOOL,
    "--no-cont-batching": BOOL,
    "--mlock": BOOL,
    "--no-mmap": BOOL,
    "--cache-type-k": STR,
    "--cache-type-v": STR,
    "--rope-freq-base": FLOAT,
    "--rope-freq-scale": FLOAT,
    "--seed": INT,
    "--chat-template": TEMPLATE,
    "--jinja": BOOL,
    "--split-mode": "choice:none|layer|row",
    "--tensor-split": STR,
    "--main-gpu": INT,
    "--timeout": INT,
    "--metrics": BOOL,
    "--n-gpu-layers": INT,
}


class LlamaServer(BackendAdapter):
    name = "llama-server"
    label = "llama-server"
    formats = ("gguf",)
    health_path = "/health"  # 503 while the model loads, 200 once it can answer
    context_flag = "--ctx-size"
    busy_path = "/slots"  # on by default (--no-slots turns it off: then the agent's stop does not wait)
    # "llama_server: listening on http://..." (0.5), "server is listening on" / "HTTP server listening" (older).
    ready_hints = ("listening on http", "server is listening", "HTTP server listening")
    # The OpenAI Responses API and Anthropic's Messages API (with count_tokens) are llama-server's own.
    inference_routes = BackendAdapter.inference_routes | {
        "/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions/input_tokens",
        "/v1/responses/input_tokens", "/v1/rerank", "/v1/reranking", "/v1/audio/transcriptions",
        "/tokenize", "/detokenize", "/apply-template", "/infill", "/rerank",
    }
    server_types = frozenset({"llm", "embedding", "rerank"})
    supports_adapters = True  # --lora-scaled at start; per-request `lora` [{id, scale}]

    def load_timeout_s(self) -> int:
        return settings.LOAD_TIMEOUT_LLAMA_S

    def requests_in_flight(self, body: bytes) -> int | None:
        """Slots processing a task: a request being answered holds one (queued ones wait for one)."""
        try:
            slots = json.loads(body)
        except ValueError:
            return None
        if not isinstance(slots, list):
            return None
        return sum(1 for slot in slots if isinstance(slot, dict) and slot.get("is_processing"))

    def allowed_flags(self, version: str) -> dict[str, str]:
        flags = dict(COMMON_FLAGS)
        if predates(version, FLASH_ATTN_VALUE_SINCE):
            flags["--flash-attn"] = BOOL
        else:
            flags["--flash-attn"] = "choice:on|off|auto"
        if not predates(version, CACHE_RAM_SINCE):
            flags["--cache-ram"] = INT
        if not predates(version, REASONING_FORMAT_SINCE):
            flags["--reasoning-format"] = "choice:none|deepseek|auto"
        if not predates(version, KV_UNIFIED_SINCE):
            flags["--kv-unified"] = BOOL
            flags["--no-kv-unified"] = BOOL
        return flags

    def serving_defaults(self, spec: LaunchSpec) -> tuple[list[str], str]:
        """The context the plan chose (BackendAdapter.context_argv). A chat model gets DEFAULT_SLOTS
        slots over one unified KV cache of that context (so no slot is cut to a sixteenth of it),
        unless the load or its preset sets the slots or the KV layout; embedding and rerank models
        keep the engine's own. On a CPU that other llama.cpp backends share, its share of the cores
        as `--threads` (BackendAdapter.cpu_threads)."""
        argv, context_why = self.context_argv(spec)
        why = [context_why] if context_why else []
        given = self.checked_extra_args(spec).keys()
        if spec.server_type == "llm" and not predates(spec.version, KV_UNIFIED_SINCE) \
                and not {"--parallel", "--kv-unified", "--no-kv-unified"} & given:
            argv += ["--parallel", str(DEFAULT_SLOTS), "--kv-unified"]
            of = "that" if spec.context else "the model's"
            why.append(f"{DEFAULT_SLOTS} slots sharing one KV cache of {of} context, for many users at once "
                       f"(with llama-server's own 4, 12 of 16 chats wait: TTFT p50 5.3 s against 2.4 s)")
        threads = self.cpu_threads(spec)
        if threads and not {"--threads", "--threads-batch"} & given:
            argv += ["--threads", str(threads)]
            why.append(self.threads_reason(spec, threads))
        return argv, "; ".join(why)

    def build_command(self, spec: LaunchSpec) -> list[str]:
        cmd = [
            spec.executable or "llama-server",
            "-m", str(spec.model_file),
            "--alias", spec.model_name,
            "--host", spec.host,
            "--port", str(spec.port),
        ]
        if spec.is_embedding:
            cmd += ["--embeddings", "--pooling", "mean"]
        elif spec.is_rerank:
            cmd += ["--reranking"]  # embeddings with rank pooling: /v1/rerank through the model's head
        if spec.api_key_file:
            cmd += self.key_argv(spec.api_key_file)
        if spec.adapters:
            # Loaded at their scale; the proxy sets each request's `lora` (every adapter's scale:
            # the named one's, 0 for the others, all 0 for the base). FNAME:SCALE,... (this build's
            # --help); serving.control.lora refuses ',' and ':' in a path.
            cmd += ["--lora-scaled", ",".join(f"{path}:{scale:g}" for _, path, scale in spec.adapters)]
        cmd += self.serving_defaults(spec)[0]
        extra = self.extra_argv(spec)
        if spec.gpus and "--n-gpu-layers" not in extra:
            cmd += ["-ngl", "999"]  # every layer on the held GPUs
        return cmd + extra

    def key_argv(self, key_file: str) -> list[str]:
        # Every route but /health, /v1/health and the web UI's assets then answers 401 without it.
        return ["--api-key-file", key_file]
