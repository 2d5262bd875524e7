"""The vLLM adapter held against vLLM itself (issue 12 #6): `vllm serve --help=all` of real
releases, recorded by bench/record_vllm_help.py into tests/serving/vllm_help/, as hardware/ holds
its parsers against recorded NVML structures. Every flag the adapter allows or writes, and every
choice it allows, must be one that release takes."""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from serving.adapters.base import LaunchSpec
from serving.adapters.vllm import VllmServer

HELP_DIR = Path(__file__).parent / "vllm_help"
VERSIONS = sorted((p.stem for p in HELP_DIR.glob("*.txt")), key=lambda v: tuple(int(x) for x in v.split(".")))
OPTION = re.compile(r"(--?[A-Za-z0-9][\w-]*)(?: (\{[^}]*\}|\['[^\]]*\]|[A-Z][A-Z0-9_]*))?")


@cache
def recorded(version: str) -> tuple[dict[str, frozenset[str] | None], bool]:
    """{flag: its choices (None: a value or a switch)} and whether the OpenAI server module exists."""
    text = (HELP_DIR / f"{version}.txt").read_text()
    flags: dict[str, frozenset[str] | None] = {}
    for line in text.splitlines():
        if not line.startswith("  -"):
            continue
        head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        for flag, arg in OPTION.findall(head):
            choices = None
            if arg.startswith("{"):
                choices = frozenset(arg[1:-1].split(","))
            elif arg.startswith("['"):  # a list of choices, not an optional [METAVAR]
                choices = frozenset(ast.literal_eval(arg))
            flags[flag] = choices
    return flags, "api_server.py: present" in text


def test_three_releases_are_recorded():
    assert len(VERSIONS) >= 3, VERSIONS
    for version in VERSIONS:
        flags, _ = recorded(version)
        assert {"--port", "--host", "--served-model-name"} <= set(flags), version  # the recording parsed


@pytest.mark.parametrize("version", VERSIONS)
def test_every_allowed_flag_and_choice_is_one_vllm_takes(version):
    flags, _ = recorded(version)
    allowed = VllmServer().allowed_flags(version)
    unknown = sorted(f for f in allowed if f not in flags)
    assert not unknown, f"vLLM {version} has no {unknown}"
    for flag, kind in allowed.items():
        if kind.startswith("choice:") and flags[flag] is not None:
            extra = set(kind.removeprefix("choice:").split("|")) - flags[flag]
            assert not extra, f"vLLM {version} {flag} takes {sorted(flags[flag])}, not {sorted(extra)}"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("server_type", ["llm", "embedding", "rerank"])
def test_the_command_the_adapter_writes_is_one_vllm_takes(version, server_type):
    flags, has_server_module = recorded(version)
    spec = LaunchSpec(model_file=Path("/m/qwen"), model_name="m", server_type=server_type, host="127.0.0.1",
                      port=8000, gpus=(0, 1), gpu_type="NVIDIA", flavour="cuda", version=version,
                      python="/usr/bin/python3", tensor_parallel_size=2)
    argv = VllmServer().build_command(spec)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and has_server_module, version
    written = [a for a in argv[3:] if a.startswith("--")]
    assert not [f for f in written if f not in flags], (version, written)
    for flag, value in zip(argv[3:], argv[4:], strict=False):
        if flag in flags and flags[flag] is not None and not value.startswith("--"):
            assert value in flags[flag], (version, flag, value)


def test_the_boundaries_read_from_the_wheels_between_the_recordings():
    """--convert reward: through 0.15.x (gone in the 0.16.0 wheel); --swap-space: through 0.17.x
    (in the 0.17.1 wheel, gone in 0.18.0). An unknown version is taken as a current one."""
    adapter = VllmServer()
    assert "reward" in adapter.allowed_flags("0.15.1")["--convert"]
    assert "reward" not in adapter.allowed_flags("0.16.0")["--convert"]
    assert "--swap-space" in adapter.allowed_flags("0.17.1") and "--swap-space" not in adapter.allowed_flags("0.18.0")
    assert "--swap-space" not in adapter.allowed_flags("")
    with pytest.raises(Exception, match="swap-space"):
        adapter.normalize_extra_args({"--swap-space": 4}, "0.33.0")
