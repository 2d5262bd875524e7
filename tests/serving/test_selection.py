"""The backend choice table: every format x GPU type x available-backends case."""
from __future__ import annotations

import itertools

import pytest

from serving.control.selection import BackendUnavailable, choose_backend

GPU_TYPES = ["NVIDIA", "AMD_CDNA", "AMD_RDNA", "CPU"]
ALL_BACKENDS = [("vllm", "cuda"), ("vllm", "rocm"), ("llama-server", "cuda"), ("llama-server", "rocm"),
                ("llama-server", "vulkan"), ("llama-server", "cpu"), ("llama-cpp-python", "cpu")]


def entries(pairs) -> list[dict]:
    return [{"name": n, "flavour": f, "available": True, "version": "0.17.0" if n == "vllm" else "1",
             "path": f"/opt/{n}", "reason": ""} for n, f in pairs]


def expected(fmt: str, gpu: str, have: set) -> tuple[str, str] | None:
    """The table as the issue states it, written independently of the implementation."""
    if fmt == "huggingface":
        want = {"NVIDIA": ("vllm", "cuda"), "AMD_CDNA": ("vllm", "rocm")}.get(gpu)
        return want if want in have else None
    order = {
        "NVIDIA": [("llama-server", "cuda"), ("llama-server", "vulkan")],
        "AMD_CDNA": [("llama-server", "rocm"), ("llama-server", "vulkan")],
        "AMD_RDNA": [("llama-server", "vulkan"), ("llama-server", "rocm")],
        "CPU": [],
    }[gpu] + [("llama-server", "cpu"), ("llama-cpp-python", "cpu")]  # llama-server first on the CPU too
    return next((p for p in order if p in have), None)


SUBSETS = [set(c) for r in range(len(ALL_BACKENDS) + 1) for c in itertools.combinations(ALL_BACKENDS, r)]


@pytest.mark.parametrize("fmt", ["gguf", "huggingface"])
@pytest.mark.parametrize("gpu", GPU_TYPES)
def test_every_case_of_the_table(fmt, gpu):
    assert len(SUBSETS) == 2 ** len(ALL_BACKENDS)
    for have in SUBSETS:
        want = expected(fmt, gpu, have)
        if want is None:
            with pytest.raises(BackendUnavailable) as err:
                choose_backend(fmt=fmt, gpu_type=gpu, backends=entries(have), node_name="node-a")
            msg = str(err.value)
            assert len(msg) > 40, msg
            if fmt == "huggingface" and gpu in ("AMD_RDNA", "CPU"):
                assert "GGUF" in msg  # says what would work
            else:
                assert "install" in msg and "node-a" in msg
            continue
        choice = choose_backend(fmt=fmt, gpu_type=gpu, backends=entries(have), node_name="node-a")
        assert (choice.backend, choice.flavour) == want, (fmt, gpu, have, choice)
        assert choice.reason and choice.backend in choice.reason
        if want == ("llama-server", "cpu") and gpu == "CPU":
            assert "faster than llama-cpp-python" in choice.reason  # the verdict says why


def test_unavailable_backends_are_ignored():
    backends = entries({("llama-server", "cuda")}) + entries({("llama-cpp-python", "cpu")})
    backends[0]["available"] = False
    choice = choose_backend(fmt="gguf", gpu_type="NVIDIA", backends=backends, node_name="n")
    assert choice.backend == "llama-cpp-python"
    assert "llama-server (cuda) is not installed on n" in choice.reason and "CPU" in choice.reason


def test_impossible_combinations_say_why_and_what_works():
    full = entries(ALL_BACKENDS)
    with pytest.raises(BackendUnavailable, match="vLLM does not support AMD RDNA.*GGUF.*Vulkan"):
        choose_backend(fmt="huggingface", gpu_type="AMD_RDNA", backends=full)
    with pytest.raises(BackendUnavailable, match="no GPU.*GGUF.*llama-cpp-python"):
        choose_backend(fmt="huggingface", gpu_type="CPU", backends=full)
    with pytest.raises(BackendUnavailable, match="vLLM does not support AMD RDNA"):
        choose_backend(fmt="huggingface", gpu_type="AMD_RDNA", backends=full, requested="vllm")


def test_explicit_backend_is_validated():
    full = entries(ALL_BACKENDS)
    c = choose_backend(fmt="gguf", gpu_type="AMD_RDNA", backends=full, requested="llama-server")
    assert (c.backend, c.flavour) == ("llama-server", "vulkan") and "explicitly" in c.reason
    c = choose_backend(fmt="gguf", gpu_type="NVIDIA", backends=full, requested="llama-cpp-python")
    assert (c.backend, c.flavour) == ("llama-cpp-python", "cpu")
    with pytest.raises(BackendUnavailable, match="unknown backend 'tgi'"):
        choose_backend(fmt="gguf", gpu_type="NVIDIA", backends=full, requested="tgi")
    with pytest.raises(BackendUnavailable, match="vllm cannot serve a gguf"):
        choose_backend(fmt="gguf", gpu_type="NVIDIA", backends=full, requested="vllm")
    with pytest.raises(BackendUnavailable, match="llama-server cannot serve a huggingface"):
        choose_backend(fmt="huggingface", gpu_type="NVIDIA", backends=full, requested="llama-server")
    with pytest.raises(BackendUnavailable, match="vllm is not installed on n"):
        choose_backend(fmt="huggingface", gpu_type="NVIDIA", backends=entries({("llama-cpp-python", "cpu")}),
                       requested="vllm", node_name="n")
    with pytest.raises(BackendUnavailable, match="built for rocm"):
        choose_backend(fmt="huggingface", gpu_type="NVIDIA", backends=entries({("vllm", "rocm")}), requested="vllm")
    assert choose_backend(fmt="gguf", gpu_type="CPU", backends=full, requested="auto").backend == "llama-server"
    only_python = entries({("llama-cpp-python", "cpu")})
    fallback = choose_backend(fmt="gguf", gpu_type="CPU", backends=only_python, node_name="n")
    assert fallback.backend == "llama-cpp-python" and "llama-server (cpu) is not installed on n" in fallback.reason


def _building(name: str, flavour: str, phase: str, *, libraries_ready: bool = False) -> dict:
    """A llama.cpp row whose build still runs (hardware.backends._build_row's shape)."""
    label = ("llama.cpp 0.3.36 building: libraries 40 %, then llama-server" if phase == "libraries"
             else "llama.cpp 0.3.36 building: 40 %")
    return {"name": name, "flavour": flavour, "available": False, "version": "1", "path": f"/opt/{name}",
            "reason": f"{name}: {label}", "build": {"state": "building", "percent": 40, "label": label,
                                                   "phase": phase, "libraries_ready": libraries_ready}}


def test_on_the_cpu_the_engine_that_is_built_first_is_chosen_while_llama_cpp_builds():
    # Both wait for the build's first phase: llama-cpp-python needs only its libraries.
    rows = [_building("llama-server", "cpu", "libraries"), _building("llama-cpp-python", "cpu", "libraries")]
    choice = choose_backend(fmt="gguf", gpu_type="CPU", backends=rows, node_name="n1")
    assert choice.backend == "llama-cpp-python"
    assert "llama-server (cpu) is still building on n1 (llama.cpp 0.3.36 building: libraries 40 %, then " \
           "llama-server); the build makes the libraries it needs first" in choice.reason, choice.reason
    assert choice.reason.endswith("(llama.cpp 0.3.36 building: libraries 40 %, then llama-server; "
                                  "the load starts when it is built)")
    # Its libraries are staged: llama-cpp-python serves now, llama-server still compiles.
    rows = [_building("llama-server", "cpu", "llama-server", libraries_ready=True),
            *entries([("llama-cpp-python", "cpu")])]
    choice = choose_backend(fmt="gguf", gpu_type="CPU", backends=rows, node_name="n1")
    assert choice.backend == "llama-cpp-python" and "this one serves now" in choice.reason, choice.reason
    assert "the load starts" not in choice.reason
    # A build from a script without phases: the table's order (llama-server first), as before.
    rows = [_building("llama-server", "cpu", ""), _building("llama-cpp-python", "cpu", "")]
    assert choose_backend(fmt="gguf", gpu_type="CPU", backends=rows).backend == "llama-server"
    # Built: llama-server, the table's first on the CPU.
    rows = entries([("llama-server", "cpu"), ("llama-cpp-python", "cpu")])
    assert choose_backend(fmt="gguf", gpu_type="CPU", backends=rows).backend == "llama-server"


def test_on_a_gpu_node_the_gpu_build_is_worth_its_wait():
    rows = [_building("llama-server", "cuda", "libraries"), *entries([("llama-cpp-python", "cpu")])]
    choice = choose_backend(fmt="gguf", gpu_type="NVIDIA", backends=rows)
    assert (choice.backend, choice.flavour) == ("llama-server", "cuda"), choice
