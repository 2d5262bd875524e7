"""Which serving backends this node can run: vLLM, llama-server binaries, llama-cpp-python.

`probe_backends()` returns one dict per backend with exactly these keys (other apps rely on
them): name, available, version, flavour ("cuda"|"rocm"|"vulkan"|"cpu"|""), path, reason.
Nothing here imports vLLM: its version and build come from package metadata.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

from hardware.detectors.torch_cuda import torch_wheel_build

PROBE_TIMEOUT_S = 10.0

# Checked in this order: ROCm builds of llama.cpp also print "ggml_cuda_init".
_FLAVOUR_MARKERS: list[tuple[str, re.Pattern]] = [
    ("rocm", re.compile(r"\brocm\b|\bhip\b|libamdhip64|libhipblas|librocblas|libggml-hip|gfx\d", re.I)),
    ("cuda", re.compile(r"\bcuda\b|libcudart|libcublas|libggml-cuda|ggml_cuda", re.I)),
    ("vulkan", re.compile(r"vulkan", re.I)),
]
_VERSION_RE = re.compile(r"^version:\s*(\S+)(?:\s+\(([0-9a-f]+)\))?", re.M)


def backend_row(name: str, *, available: bool, version: str = "", flavour: str = "", path: str = "",
                reason: str = "") -> dict:
    """One probe result in the shared shape."""
    return {"name": name, "available": available, "version": version, "flavour": flavour, "path": path,
            "reason": reason}


def flavour_from_text(text: str) -> str:
    """Build flavour named in `llama-server --version` output, ldd output or library names; cpu if none."""
    for flavour, pattern in _FLAVOUR_MARKERS:
        if pattern.search(text):
            return flavour
    return "cpu"


def parse_llama_server_version(output: str) -> str:
    """"4880 (2c9f833d)" from a `version: 4880 (2c9f833d)` line; "" when absent."""
    match = _VERSION_RE.search(output)
    if not match:
        return ""
    return f"{match.group(1)} ({match.group(2)})" if match.group(2) else match.group(1)


def _run(cmd: list[str]) -> str:
    """stdout+stderr of a short command; "" when it fails or hangs."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, errors="replace")
    except (OSError, subprocess.SubprocessError):
        return ""
    return (done.stdout or "") + (done.stderr or "")


def probe_llama_server(binary: str | None = None) -> dict:
    """The llama-server on PATH: version from `--version`; flavour from its output, linked libs, or
    the backend libraries beside it (builds that load ggml backends at run time)."""
    path = binary or shutil.which("llama-server")
    if not path:
        return backend_row("llama-server", available=False, reason="llama-server: not found on PATH")
    output = _run([path, "--version"])
    version = parse_llama_server_version(output)
    if not output.strip():
        return backend_row("llama-server", available=False, path=path,
                           reason="llama-server: `--version` failed or timed out")
    evidence = output
    if flavour_from_text(evidence) == "cpu":
        evidence += "\n" + _run(["ldd", path])
        evidence += "\n" + " ".join(p.name for p in Path(path).resolve().parent.glob("libggml-*"))
    return backend_row("llama-server", available=True, version=version, flavour=flavour_from_text(evidence),
                       path=path)


def _installed(package: str) -> bool:
    try:
        importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def probe_vllm() -> dict:
    """vLLM from package metadata; flavour from its own version suffix, else from torch's build."""
    try:
        dist = importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return backend_row("vllm", available=False, reason="vllm: not installed")
    version = dist.version
    local = version.partition("+")[2].lower()
    if "rocm" in local:
        flavour = "rocm"
    elif local.startswith("cu"):
        flavour = "cuda"
    elif local == "cpu":
        flavour = "cpu"
    else:
        flavour = torch_wheel_build() or ("cuda" if _installed("torch") else "")
    path = shutil.which("vllm") or str(dist.locate_file("vllm"))
    if flavour == "cpu":
        return backend_row("vllm", available=False, version=version, flavour=flavour, path=path,
                           reason="vllm: installed with a CPU-only torch; it needs a CUDA or ROCm build")
    return backend_row("vllm", available=True, version=version, flavour=flavour, path=path)


def probe_llama_cpp_python() -> dict:
    """llama-cpp-python: importable, its version, and the ggml backend libraries it ships."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return backend_row("llama-cpp-python", available=False, reason="llama-cpp-python: not installed")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        version = ""
    # Imported in a child process: proves libllama loads here without putting it (or a crash
    # of a mismatched GPU build) into the agent.
    try:
        check = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, text=True,
                               timeout=PROBE_TIMEOUT_S * 3, stdin=subprocess.DEVNULL, errors="replace")
        failure = check.stderr.strip().splitlines()[-1] if check.returncode else ""
        failure = failure or (f"exit code {check.returncode}" if check.returncode else "")
    except subprocess.TimeoutExpired:
        failure = "import timed out"
    if failure:
        return backend_row("llama-cpp-python", available=False, version=version, path=str(package_dir),
                           reason=f"llama-cpp-python: import failed: {failure}")
    libs = " ".join(p.name for p in (package_dir / "lib").glob("*"))
    return backend_row("llama-cpp-python", available=True, version=version, flavour=flavour_from_text(libs),
                       path=str(package_dir))


PROBES = {
    "vllm": probe_vllm,
    "llama-server": probe_llama_server,
    "llama-cpp-python": probe_llama_cpp_python,
}


def probe_backends() -> list[dict]:
    """Every backend's availability on this node (see the module docstring for the shape)."""
    rows = []
    for name, probe in PROBES.items():
        try:
            rows.append(probe())
        except Exception as exc:  # one broken install must not hide the others
            rows.append(backend_row(name, available=False, reason=f"{name}: probe failed: {exc}"))
    return rows
