"""The backend adapter contract: how one inference server is started, checked and warmed up.

An adapter turns a `LaunchSpec` (what to serve, where, on which GPUs) into an argv list and an
environment. Nothing here starts a process or touches the database; the supervisor does that.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

FLAG_RE = re.compile(r"^--[a-z0-9][a-z0-9_-]{0,63}$")
MAX_VALUE_LEN = 512


class InvalidExtraArgs(ValueError):
    """An extra argument the backend does not know, or a value that is not acceptable."""


@dataclass(frozen=True)
class LaunchSpec:
    """Everything an adapter needs to build a command line."""

    model_file: Path  # a .gguf file, or a directory with config.json
    model_name: str
    server_type: str  # "llm" | "embedding"
    host: str
    port: int
    gpus: tuple[int, ...] = ()
    gpu_type: str = ""  # NVIDIA | AMD_CDNA | AMD_RDNA | "" (CPU)
    flavour: str = ""  # cuda | rocm | vulkan | cpu | ""
    version: str = ""
    executable: str = ""  # the backend's binary when it is not a Python module (llama-server)
    tensor_parallel_size: int = 1
    extra_args: dict = field(default_factory=dict)

    @property
    def is_embedding(self) -> bool:
        return self.server_type == "embedding"


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


class BackendAdapter:
    """One inference server. Subclasses fill in the class attributes and `build_command`."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    formats: ClassVar[tuple[str, ...]] = ()  # model formats it serves: "gguf", "huggingface"
    health_path: ClassVar[str] = "/health"
    # Log lines that mean "probably up now": they only make the health poll happen sooner.
    ready_hints: ClassVar[tuple[str, ...]] = ("Uvicorn running on",)

    def load_timeout_s(self) -> int:
        raise NotImplementedError

    def allowed_flags(self, version: str) -> dict[str, str]:
        """Flag -> kind of value, for extra_args on this version. Flags the adapter sets itself are absent."""
        raise NotImplementedError

    def build_command(self, spec: LaunchSpec) -> list[str]:
        raise NotImplementedError

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

    def build_env(self, spec: LaunchSpec, base: dict[str, str]) -> dict[str, str]:
        """The child's environment: the agent's, offline by default, plus device visibility."""
        env = dict(base)
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
        env.update(self.device_env(spec))
        return env

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
                return int(text)
            except ValueError:
                raise InvalidExtraArgs(f"{flag} needs a whole number, got {text[:40]!r}") from None
        if kind == FLOAT:
            try:
                return float(text)
            except ValueError:
                raise InvalidExtraArgs(f"{flag} needs a number, got {text[:40]!r}") from None
        if text.lstrip().startswith("-"):
            raise InvalidExtraArgs(f"the value of {flag} may not start with '-' (it would read as another flag)")
        if kind.startswith("choice:"):
            choices = kind.split(":", 1)[1].split("|")
            if text not in choices:
                raise InvalidExtraArgs(f"{flag} must be one of {', '.join(choices)}")
        return text

    def extra_argv(self, spec: LaunchSpec) -> list[str]:
        """extra_args as argv items (validated again: the row may predate a version change)."""
        argv: list[str] = []
        for flag, value in self.normalize_extra_args(spec.extra_args, spec.version).items():
            if value is True:
                argv.append(flag)
            elif value is False:
                continue
            else:
                argv += [flag, str(value)]
        return argv

    def warmup_request(self, spec: LaunchSpec) -> tuple[str, dict]:
        """One small request that proves the model answers: (path, JSON body)."""
        if spec.is_embedding:
            return "/v1/embeddings", {"model": spec.model_name, "input": "warm-up"}
        return "/v1/chat/completions", {
            "model": spec.model_name,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
        }
