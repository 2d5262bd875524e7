"""The backend adapter contract: how one inference server is started, checked and warmed up.

An adapter turns a `LaunchSpec` (what to serve, where, on which GPUs) into an argv list and the
environment variables it adds; `backend_environment` is the whole environment a backend gets
(an allowlist of the agent's, never its secrets). Nothing here starts a process or touches the
database; the supervisor does that.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

from django.conf import settings

FLAG_RE = re.compile(r"^--[a-z0-9][a-z0-9_-]{0,63}$")
MAX_VALUE_LEN = 512
# Whole-number flags (context, batch, threads, seeds) stay far inside this; beyond it the
# memory estimate overflows and no backend would take the value anyway.
INT_LIMIT = 2**32

# What a backend may see of the agent's environment: enough to run (paths, locale, temp dir, the
# GPU runtime's own settings), never the console's (secret key, database URL, store keys, admin
# password). XGEN_BACKEND_ENV names more variables to pass.
ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "LD_LIBRARY_PATH", "PYTHONPATH",
    "LLAMA_CPP_LIB_PATH",  # the one-compile install: llama-cpp-python loads the cached libllama from there
    "HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME",
})
ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "ROCR_", "ROCM_", "HIP_", "HSA_", "VK_", "GGML_", "OMP_")
# Children never reach the Hub on their own: models come from the node cache.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def backend_environment(additions: Mapping[str, str], agent_env: Mapping[str, str]) -> dict[str, str]:
    """A backend's whole environment: the allowlisted part of the agent's, plus `additions`."""
    extra = set(getattr(settings, "BACKEND_ENV_PASS", ()))
    env = {k: v for k, v in agent_env.items()
           if k in ENV_NAMES or k in extra or k.startswith(ENV_PREFIXES)}
    env.update(additions)
    return env


class Served(Protocol):
    """What a warm-up request needs to know of an instance (a LaunchSpec or a LaunchPlan)."""

    model_name: str

    @property
    def is_embedding(self) -> bool: ...

    @property
    def is_rerank(self) -> bool: ...


class InvalidExtraArgs(ValueError):
    """An extra argument the backend does not know, or a value that is not acceptable."""


@dataclass(frozen=True)
class LaunchSpec:
    """Everything an adapter needs to build a command line."""

    model_file: Path  # a .gguf file, or a directory with config.json
    model_name: str
    server_type: str  # "llm" | "embedding" | "rerank"
    host: str
    port: int | str  # a number, or the plan's placeholder the agent fills in
    gpus: tuple[int, ...] = ()
    gpu_type: str = ""  # NVIDIA | AMD_CDNA | AMD_RDNA | "" (CPU)
    flavour: str = ""  # cuda | rocm | vulkan | cpu | ""
    version: str = ""
    executable: str = ""  # the backend's binary when it is not a Python module (llama-server)
    python: str = ""  # the interpreter a Python-module backend runs in (default: this one)
    tensor_parallel_size: int = 1
    extra_args: dict = field(default_factory=dict)
    extra_args_checked: bool = False  # already normalize_extra_args()'s output (the plan checks them once)
    api_key_file: str = ""  # the file holding the instance's backend secret (or the plan's placeholder)
    # LoRA adapters loaded with the model (issue 27): ((name, path, scale), ...), checked by
    # serving.control.lora; an adapter whose `supports_adapters` is False never gets any.
    adapters: tuple[tuple[str, str, float], ...] = ()
    # The node's CPU (issue 28 #2): its cores, and how many llama.cpp backends run on them, this one
    # included, when it runs on the CPU (each then gets its share of threads: `cpu_threads`).
    cpu_cores: int = 0
    cpu_backends: int = 1
    # The context the console chose where the load sets none (serving.control.planning.make_launch_plan,
    # context_choices: the model's trained context, or less where its KV cache would not fit), and the
    # verdict's words.
    context: int = 0
    context_reason: str = ""
    context_trained: int = 0  # the model's own context, where the plan read it
    # The fraction of each GPU's memory the plan gives an engine that takes a fixed share at start
    # (BackendAdapter.gpu_share_flag; serving.control.planning.gpu_share); 0.0: none set.
    gpu_share: float = 0.0

    @property
    def is_embedding(self) -> bool:
        return self.server_type == "embedding"

    @property
    def is_rerank(self) -> bool:
        return self.server_type == "rerank"


# The flags that set a context, each engine's (llama-server, llama-cpp-python, vLLM): a load's own
# context is the one of these it sets (serving.control.planning), and the plan's then adds none.
CTX_FLAGS = ("--ctx-size", "--n_ctx", "--max-model-len")


def share_text(share: float) -> str:
    """A fraction of a GPU's memory as vLLM's --gpu-memory-utilization gets it: 0.9 -> "0.90", 0.033 -> "0.033"."""
    return f"{share:.2f}" if round(share * 100, 6).is_integer() else f"{share:.3f}"


def parse_version(version: str) -> tuple[int, ...]:
    """'0.10.1rc2+cu128' -> (0, 10, 1); 'b6123' -> (6123,); '' -> ()."""
    text = (version or "").strip().lower().lstrip("v")
    if text.startswith("b") and text[1:].split("-")[0].isdigit():
        return (int(text[1:].split("-")[0]),)
    nums: list[int] = []
    for part in re.split(r"[.+-]", text):
        m = re.match(r"^(\d+)", part)
        if not m:
            break
        nums.append(int(m.group(1)))
        if m.group(1) != part:
            break
    return tuple(nums)


# Kinds of value an allowlisted flag takes.
BOOL = "bool"  # True -> bare flag; False/None -> omitted
INT = "int"
FLOAT = "float"
STR = "str"
# A chat template given inline, or a template's name; never a file: the backend would read any
# file of the node it names (engines take a path there, and fall back to the text).
TEMPLATE = "template"


# The inference routes the proxy forwards to a server (its paths on the backend), an allowlist per
# engine: its session, control and admin routes (llama-server's /slots, /props, /v1/streams/lookup,
# /v1/chat/completions/control, /lora-adapters; vLLM's /sleep, /collective_rpc,
# /v1/load_lora_adapter, ...) never reach it through the console. Held against each engine's route
# table by tests/serving/test_engine_routes.py, which says why each route left out is.
OPENAI_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})


class BackendAdapter:
    """One inference server. Subclasses fill in the class attributes and `build_command`."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    formats: ClassVar[tuple[str, ...]] = ()  # model formats it serves: "gguf", "huggingface"
    health_path: ClassVar[str] = "/health"
    # Where the server says how many requests it is answering ("": it cannot say): a stopping node
    # agent waits for none before it stops the server (Supervisor.drain). See requests_in_flight.
    busy_path: ClassVar[str] = ""
    # Log lines that mean "probably up now": they only make the health poll happen sooner.
    ready_hints: ClassVar[tuple[str, ...]] = ("Uvicorn running on",)
    # The routes the server answers itself (the proxy translates /v1/messages to chat completions
    # where it is absent, and refuses the others: 404 unsupported_by_backend).
    inference_routes: ClassVar[frozenset[str]] = OPENAI_ROUTES
    # The kinds of model (server_type) it can serve; selection skips it for the others.
    server_types: ClassVar[frozenset[str]] = frozenset({"llm", "embedding"})
    supports_adapters: ClassVar[bool] = False  # LoRA adapters at start (LaunchSpec.adapters)
    # The flag that sets the context, where the console chooses it when the load does not ("": the
    # engine's own default stands). llama.cpp's default is the model's trained context (128k tokens
    # of KV cache for many models), and on a GPU it shrinks it to take all free memory but 1 GiB
    # (`--fit on`); the plan's estimate must be what the engine allocates.
    context_flag: ClassVar[str] = ""
    # An engine whose own default is the model's context sets the flag only for a smaller one.
    context_only_smaller: ClassVar[bool] = False
    # The flag of an engine that takes a fixed share of each GPU's memory at start, whatever the
    # model needs (vLLM); the plan sets it and counts that share as the instance's memory.
    gpu_share_flag: ClassVar[str] = ""

    def serves(self, path: str, version: str = "") -> bool:
        """Whether the proxy may send `path` to this server (one of its inference routes)."""
        return path in self.inference_routes

    def load_timeout_s(self) -> int:
        raise NotImplementedError

    def requests_in_flight(self, body: bytes) -> int | None:
        """The requests being answered, from busy_path's answer; None when it does not say."""
        return None

    def runtime_adapters(self, version: str) -> bool:
        """Whether this version adds and removes LoRA adapters while it runs (else a change restarts it)."""
        return False

    def allowed_flags(self, version: str) -> dict[str, str]:
        """Flag -> kind of value, for extra_args on this version. Flags the adapter sets itself are absent."""
        raise NotImplementedError

    def build_command(self, spec: LaunchSpec) -> list[str]:
        raise NotImplementedError

    def serving_defaults(self, spec: LaunchSpec) -> tuple[list[str], str]:
        """The argv the console adds for many users at once where the load sets none of it (issue
        28 #2), and why, for the verdict; ([], "") where the engine's own defaults stand."""
        return [], ""

    def context_argv(self, spec: LaunchSpec) -> tuple[list[str], str]:
        """`context_flag N` and why, for the context the plan chose (LaunchSpec.context)."""
        if not spec.context or not self.context_flag or set(CTX_FLAGS) & self.checked_extra_args(spec).keys():
            return [], ""
        if self.context_only_smaller and spec.context >= spec.context_trained:
            return [], ""
        return [self.context_flag, str(spec.context)], spec.context_reason

    @staticmethod
    def cpu_threads(spec: LaunchSpec) -> int | None:
        """Threads for a backend that shares the node's CPU with other llama.cpp backends: its
        share of the cores (at least 1); None when it runs alone or on GPUs (the engine's own
        default: every core). ggml's threads spin while they wait for one another, so two backends
        that each take every core of a 2-core node slow each other down far more than half."""
        if spec.gpus or spec.cpu_cores <= 0 or spec.cpu_backends <= 1:
            return None
        return max(1, spec.cpu_cores // spec.cpu_backends)

    @staticmethod
    def threads_reason(spec: LaunchSpec, threads: int) -> str:
        """The verdict's words for `cpu_threads`."""
        return (f"{threads} thread{'s' if threads != 1 else ''}: its share of the node's {spec.cpu_cores} cores "
                f"with {spec.cpu_backends - 1} other llama.cpp backend{'s' if spec.cpu_backends != 2 else ''} on "
                "the CPU")

    def device_env(self, spec: LaunchSpec) -> dict[str, str]:
        """Which GPUs the process may see."""
        ids = ",".join(str(g) for g in spec.gpus)
        if spec.gpu_type == "NVIDIA":
            return {"CUDA_VISIBLE_DEVICES": ids}
        if spec.gpu_type in ("AMD_CDNA", "AMD_RDNA"):
            if spec.flavour == "vulkan":
                return {"GGML_VK_VISIBLE_DEVICES": ids}
            return {"HIP_VISIBLE_DEVICES": ids}
        # A CPU placement must not grab a GPU by accident.
        return {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""} if spec.gpu_type else {}

    def key_argv(self, key_file: str) -> list[str]:
        """The argv items that make the server require the secret in `key_file` ([]: it takes it
        from the environment, see key_env). Never the secret itself: argv shows in `ps`."""
        return []

    def key_env(self, secret: str) -> dict[str, str]:
        """The environment that makes the server require `secret` as a bearer token ({}: it reads
        a file, see key_argv)."""
        return {}

    def env_additions(self, spec: LaunchSpec) -> dict[str, str]:
        """What the backend's environment adds to the allowlisted base: offline, device visibility."""
        return {**OFFLINE_ENV, **self.device_env(spec)}

    def build_env(self, spec: LaunchSpec, base: Mapping[str, str]) -> dict[str, str]:
        """The child's environment: the allowlisted part of `base` (the agent's) plus env_additions."""
        return backend_environment(self.env_additions(spec), base)

    def normalize_extra_args(self, extra_args: dict | None, version: str) -> dict[str, object]:
        """Validated {--flag: value}; raises InvalidExtraArgs naming the offending flag."""
        allowed = self.allowed_flags(version)
        out: dict[str, object] = {}
        for raw_flag, value in (extra_args or {}).items():
            flag = raw_flag.strip() if isinstance(raw_flag, str) else ""
            if flag and not flag.startswith("-"):
                flag = "--" + flag
            if not FLAG_RE.match(flag):
                raise InvalidExtraArgs(f"'{str(raw_flag)[:80]}' is not a flag (expected --name)")
            kind = allowed.get(flag)
            if kind is None:
                raise InvalidExtraArgs(
                    f"{self.label} {version or ''} does not accept {flag} as an extra argument "
                    f"(allowed: {', '.join(sorted(allowed))})".replace("  ", " ")
                )
            if value is None or value is False:
                if kind == BOOL or value is None:
                    continue
            out[flag] = self._check_value(flag, kind, value)
        return out

    def _check_value(self, flag: str, kind: str, value: object) -> object:
        if kind == BOOL:
            if value is True or (isinstance(value, str) and value.lower() in ("true", "1", "yes", "")):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no"):
                return False
            raise InvalidExtraArgs(f"{flag} is an on/off flag; give true or false")
        if isinstance(value, bool):
            raise InvalidExtraArgs(f"{flag} needs a value, not true/false")
        text = str(value)
        if len(text) > MAX_VALUE_LEN or any(c in text for c in "\n\r\0"):
            raise InvalidExtraArgs(f"the value of {flag} is too long or has a newline/NUL")
        if not text.strip():
            raise InvalidExtraArgs(f"{flag} needs a value")
        if kind == INT:
            try:
                number = int(text)
            except ValueError:
                raise InvalidExtraArgs(f"{flag} needs a whole number, got {text[:40]!r}") from None
            if not -INT_LIMIT <= number <= INT_LIMIT:
                raise InvalidExtraArgs(f"{flag} needs a whole number between {-INT_LIMIT} and {INT_LIMIT}, "
                                       f"got {text[:40]}{'...' if len(text) > 40 else ''}")
            return number
        if kind == FLOAT:
            try:
                number = float(text)
            except ValueError:
                raise InvalidExtraArgs(f"{flag} needs a number, got {text[:40]!r}") from None
            if not math.isfinite(number):
                raise InvalidExtraArgs(f"{flag} needs a finite number, got {text[:40]!r}")
            return number
        if text.lstrip().startswith("-"):
            raise InvalidExtraArgs(f"the value of {flag} may not start with '-' (it would read as another flag)")
        if kind == TEMPLATE and ("{{" not in text and "{%" not in text) and (
                "/" in text or "\\" in text or text.startswith((".", "~"))):
            raise InvalidExtraArgs(f"{flag} takes a template inline or a template's name, not a file path")
        if kind.startswith("choice:"):
            choices = kind.split(":", 1)[1].split("|")
            if text not in choices:
                raise InvalidExtraArgs(f"{flag} must be one of {', '.join(choices)}")
        return text

    def checked_extra_args(self, spec: LaunchSpec) -> dict:
        """The spec's extra_args as normalize_extra_args gives them (unless the spec says they are)."""
        return spec.extra_args if spec.extra_args_checked else self.normalize_extra_args(spec.extra_args, spec.version)

    def extra_argv(self, spec: LaunchSpec) -> list[str]:
        """extra_args as argv items (checked here unless the spec says they were)."""
        argv: list[str] = []
        for flag, value in self.checked_extra_args(spec).items():
            if value is True:
                argv.append(flag)
            elif value is False:
                continue
            else:
                argv += [flag, str(value)]
        return argv

    def warmup_request(self, spec: Served) -> tuple[str, dict]:
        """One small request that proves the model answers: (path, JSON body)."""
        if spec.is_embedding:
            return "/v1/embeddings", {"model": spec.model_name, "input": "warm-up"}
        if spec.is_rerank:
            return "/v1/rerank", {"model": spec.model_name, "query": "warm-up", "documents": ["warm-up"]}
        return "/v1/chat/completions", {
            "model": spec.model_name,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
        }
