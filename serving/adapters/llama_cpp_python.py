"""llama-cpp-python's OpenAI server: the CPU fallback for GGUF files (and the tests' engine)."""
from __future__ import annotations

import sys

from django.conf import settings

from serving.adapters.base import FLOAT, INT, STR, BackendAdapter, LaunchSpec

# Its boolean settings take an explicit value (`--verbose false`), never a bare switch.
ON_OFF = "choice:true|false"

FLAGS = {
    "--n_ctx": INT,
    "--n_threads": INT,
    "--n_threads_batch": INT,
    "--n_batch": INT,
    "--n_ubatch": INT,
    "--n_gpu_layers": INT,
    "--main_gpu": INT,
    "--seed": INT,
    "--chat_format": STR,
    "--rope_freq_base": FLOAT,
    "--rope_freq_scale": FLOAT,
    "--use_mlock": ON_OFF,
    "--use_mmap": ON_OFF,
    "--flash_attn": ON_OFF,
    "--verbose": ON_OFF,
    "--cache": ON_OFF,
    "--cache_size": INT,
    "--interrupt_requests": ON_OFF,
}


class LlamaCppPythonServer(BackendAdapter):
    name = "llama-cpp-python"
    context_flag = "--n_ctx"  # its own default is 2,048 tokens, whatever the model was trained for
    label = "llama-cpp-python"
    formats = ("gguf",)
    health_path = "/v1/models"
    ready_hints = ("Uvicorn running on",)

    def load_timeout_s(self) -> int:
        return settings.LOAD_TIMEOUT_LLAMA_S

    def allowed_flags(self, version: str) -> dict[str, str]:
        return dict(FLAGS)

    def _check_value(self, flag: str, kind: str, value: object) -> object:
        if kind == ON_OFF and isinstance(value, bool):
            value = "true" if value else "false"
        return super()._check_value(flag, kind, value)

    def key_env(self, secret: str) -> dict[str, str]:
        # ServerSettings (pydantic-settings) reads `api_key` from API_KEY when --api_key is absent.
        return {"API_KEY": secret}

    def serving_defaults(self, spec: LaunchSpec) -> tuple[list[str], str]:
        """The context the plan chose (BackendAdapter.context_argv); on a CPU that other llama.cpp
        backends share, its share of the cores (BackendAdapter.cpu_threads) for generation and prompt
        processing alike, unless the load sets either."""
        argv, why = self.context_argv(spec)
        threads = self.cpu_threads(spec)
        if not threads or {"--n_threads", "--n_threads_batch"} & self.checked_extra_args(spec).keys():
            return argv, why
        return (argv + ["--n_threads", str(threads), "--n_threads_batch", str(threads)],
                "; ".join(filter(None, (why, self.threads_reason(spec, threads)))))

    def build_command(self, spec: LaunchSpec) -> list[str]:
        cmd = [
            spec.python or sys.executable, "-m", "llama_cpp.server",
            "--model", str(spec.model_file),
            "--model_alias", spec.model_name,
            "--host", spec.host,
            "--port", str(spec.port),
        ]
        if spec.is_embedding:
            cmd += ["--embedding", "true"]
        extra = self.extra_argv(spec)
        if spec.gpus and "--n_gpu_layers" not in extra:
            cmd += ["--n_gpu_layers", "-1"]
        if "--interrupt_requests" not in extra:
            # Its default (true) ends the answer being streamed whenever another request arrives:
            # 3 of 4 concurrent chats came back 200 with a role chunk and [DONE], no text
            # (bench/engines.py). Requests then wait their turn instead (one answers at a time).
            cmd += ["--interrupt_requests", "false"]
        return cmd + self.serving_defaults(spec)[0] + extra
