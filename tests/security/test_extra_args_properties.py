"""Property tests (Hypothesis) for extra_args: whatever a client sends, the backend's argv holds
only flags the backend allows, never one the adapter sets itself, and no value that smuggles a
flag, a newline or a NUL. Anything else is refused with InvalidExtraArgs."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.adapters import get_adapter
from serving.adapters.base import InvalidExtraArgs, LaunchSpec

BACKENDS = [("llama-cpp-python", "0.3.36", "cpu"), ("llama-server", "b6500", "cuda"), ("vllm", "0.10.1", "cuda"),
            ("vllm", "0.9.2", "rocm"), ("vllm", "0.33.0", "cuda")]
ADAPTER_SET = {"--model", "-m", "--host", "--port", "--model_alias", "--alias", "--served-model-name"}

nasty_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["--model /etc/passwd", "--port=1", "; rm -rf /", "$(id)", "a\nb", "x\0y", "-1", "--", "true",
                     "false", "", " ", "0", "1e309", "NaN", "--host 0.0.0.0"]),
)
flag_names = st.one_of(
    st.sampled_from(sorted(ADAPTER_SET | {"--n_ctx", "--ctx-size", "--flash-attn", "--max-model-len", "--dtype",
                                          "--verbose", "--n_gpu_layers", "-ngl", "--gpu-memory-utilization",
                                          "--tensor-parallel-size", "--embedding", "--api-key", "n_ctx", "ctx-size"})),
    st.text(max_size=30),
)
values = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**9), st.floats(allow_nan=True), nasty_text)


@pytest.mark.parametrize("backend,version,flavour", BACKENDS)
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_extra_args_never_reach_argv_unchecked(backend, version, flavour, data):
    adapter = get_adapter(backend)
    allowed = adapter.allowed_flags(version)
    # Half the flags from the backend's own allowlist, so values meet every kind of flag.
    names = st.one_of(flag_names, st.sampled_from(sorted(allowed)))
    extra = data.draw(st.dictionaries(names, values, max_size=4))
    assert not (ADAPTER_SET & set(allowed)), "flags the adapter sets itself must not be allowed"
    try:
        clean = adapter.normalize_extra_args(extra, version)
    except InvalidExtraArgs as exc:
        assert str(exc)
        return
    assert set(clean) <= set(allowed)
    spec = LaunchSpec(model_file=Path("/models/m.gguf"), model_name="m", server_type="llm", host="127.0.0.1",
                      port=18000, gpus=(), gpu_type="", flavour=flavour, version=version, executable="",
                      tensor_parallel_size=1, extra_args=clean)
    argv = adapter.extra_argv(spec)
    flags = [a for a in argv if a in allowed]
    values_out = [a for a in argv if a not in allowed]
    assert len(set(flags)) == len(flags)
    for value in values_out:
        assert "\n" not in value and "\0" not in value and "\r" not in value
        assert not value.startswith("--"), f"a value that looks like a flag reached argv: {value!r}"
    command = adapter.build_command(spec)
    assert command.count("--port") + command.count("-p") <= 1
    for own in ("--host", "--port"):
        if own in command:
            assert command.count(own) == 1


@pytest.mark.parametrize("backend,version,flag", [("llama-server", "b6500", "--chat-template"),
                                                   ("vllm", "0.10.1", "--quantization"),
                                                   ("llama-cpp-python", "0.3.36", "--chat_format")])
def test_a_flag_shaped_value_is_refused(backend, version, flag):
    with pytest.raises(InvalidExtraArgs, match="may not start with '-'"):
        get_adapter(backend).normalize_extra_args({flag: "--model /etc/passwd"}, version)
