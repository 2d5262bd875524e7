"""Which serving backends this node can run: vLLM, llama-server binaries, llama-cpp-python.

`probe_backends()` returns one dict per backend with exactly these keys (other apps rely on
them): name, available, version, flavour ("cuda"|"rocm"|"vulkan"|"cpu"|""), path, reason.
Nothing here imports vLLM: its version and build come from package metadata.

llama.cpp is built once per llama-cpp-python version by `deploy/build_llama_cpp.sh` into
`$XGEN_CACHE_DIR/llama.cpp/<version>/` (bin/llama-server and lib/ with libllama): the same
compile serves llama-server and, through LLAMA_CPP_LIB_PATH, a llama-cpp-python installed
without its own library (`CMAKE_ARGS=-DLLAMA_BUILD=OFF`). `llama_cpp_lib_env()` says whether
that variable is needed; the hardware app exports it at start (hardware/apps.py) and every probe
again (a build that ends after the start).

While that build runs (or after it failed) the llama.cpp rows carry one more key, `build`
(hardware.llama_build.BuildState.to_json: state building|failed, percent, label): a load may
choose an engine that is still building and waits for it (serving.node.supervisor).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from hardware.detectors.torch_cuda import torch_wheel_build
from hardware.llama_build import BuildState, build_state

PROBE_TIMEOUT_S = 10.0

# Checked in this order: ROCm builds of llama.cpp also print "ggml_cuda_init".
_FLAVOUR_MARKERS: list[tuple[str, re.Pattern[str]]] = [
    ("rocm", re.compile(r"\brocm\b|\bhip\b|libamdhip64|libhipblas|librocblas|libggml-hip|gfx\d", re.I)),
    ("cuda", re.compile(r"\bcuda\b|libcudart|libcublas|libggml-cuda|ggml_cuda", re.I)),
    ("vulkan", re.compile(r"vulkan", re.I)),
]
_VERSION_RE = re.compile(r"^version:\s*(\S+)(?:\s+\(([^()\n]+)\))?", re.M)


def backend_row(name: str, *, available: bool, version: str = "", flavour: str = "", path: str = "",
                reason: str = "") -> dict[str, Any]:
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
    """The `version:` line of `llama-server --version`, in either of llama.cpp's formats:
    "4880 (2c9f833d)" from `version: 4880 (2c9f833d)` (build numbers), "0.5.0 (build 8123, commit
    2c9f833d)" from the semantic versions that followed; "" when absent."""
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


# ---------------------------------------------------------------- the llama.cpp build cache
def cache_dir() -> Path:
    """XGEN_CACHE_DIR (settings.CACHE_DIR): builds and downloads kept outside the repository."""
    from django.conf import settings

    return Path(settings.CACHE_DIR)


def llama_cpp_python_version() -> str:
    """The installed llama-cpp-python's version from its metadata (no import); "" when absent."""
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return ""


def llama_cpp_build(version: str | None = None) -> Path | None:
    """The complete cached llama.cpp build for `version` (default: the installed llama-cpp-python's,
    else the newest one cached); None when there is none. Complete = its build.json is written."""
    root = cache_dir() / "llama.cpp"
    version = llama_cpp_python_version() if version is None else version
    if version:
        build = root / version
        return build if (build / "build.json").is_file() else None
    builds = sorted((p for p in root.glob("*") if (p / "build.json").is_file()), key=lambda p: p.stat().st_mtime)
    return builds[-1] if builds else None


def llama_cpp_build_state(version: str | None = None) -> BuildState | None:
    """The llama.cpp build of `version` (default: the installed llama-cpp-python's) that is running
    or failed beside the cache, CPU build first, then a GPU one; None when there is none."""
    version = llama_cpp_python_version() if version is None else version
    if not version:
        return None
    root = cache_dir() / "llama.cpp"
    for name in (version, f"{version}-cuda", f"{version}-hip"):
        state = build_state(root, name)
        if state is not None:
            return state
    return None


def waiting_build(backend: str, executable: str = "") -> BuildState | None:
    """The build a start of `backend` must wait for (or that failed), when that engine is not here
    yet: llama-server whose `executable` does not exist, llama-cpp-python without a libllama to
    load. None when the engine is here, is no llama.cpp engine, or no build runs or failed."""
    if backend == "llama-server":
        if executable and os.access(executable, os.X_OK):
            return None
    elif backend == "llama-cpp-python":
        package_dir = _llama_cpp_package()
        if (package_dir is not None and _own_llama_lib(package_dir)) or os.environ.get("LLAMA_CPP_LIB_PATH") \
                or llama_cpp_lib_env():
            return None
    else:
        return None
    return llama_cpp_build_state()


def _build_row(name: str, state: BuildState, path: str) -> dict[str, Any]:
    """A llama.cpp engine that is not here yet: its build runs (or failed); `build` says which."""
    version = state.llama_server_version if name == "llama-server" else state.version.split("-")[0]
    row = backend_row(name, available=False, version=version, flavour=state.to_json()["flavour"], path=path,
                      reason=f"{name}: {state.label}")
    row["build"] = state.to_json()
    return row


def build_info(build: Path) -> dict[str, Any]:
    """What deploy/build_llama_cpp.sh recorded about a build ({} when unreadable)."""
    try:
        return json.loads((build / "build.json").read_text())
    except (OSError, ValueError):
        return {}


def find_llama_server() -> tuple[str | None, str]:
    """(binary, where it came from): XGEN_LLAMA_SERVER_BIN, else PATH, else the cached build."""
    from django.conf import settings

    if settings.LLAMA_SERVER_BIN:
        return settings.LLAMA_SERVER_BIN, "XGEN_LLAMA_SERVER_BIN"
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path, "PATH"
    build = llama_cpp_build()
    if build is not None and os.access(build / "bin" / "llama-server", os.X_OK):
        return str(build / "bin" / "llama-server"), "cache"
    return None, ""


def _llama_cpp_package() -> Path | None:
    """llama-cpp-python's package folder (found without importing it), None when not installed."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _own_llama_lib(package_dir: Path) -> bool:
    return any((package_dir / "lib").glob("libllama.*"))


def llama_cpp_lib_env() -> dict[str, str]:
    """{"LLAMA_CPP_LIB_PATH": dir} when llama-cpp-python has no libllama of its own (installed
    with -DLLAMA_BUILD=OFF) and the cached build of its version has one; else {} (a library it
    ships, e.g. a CUDA wheel's, and a LLAMA_CPP_LIB_PATH already set are left alone)."""
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return {}
    package_dir = _llama_cpp_package()
    if package_dir is None or _own_llama_lib(package_dir):
        return {}
    build = llama_cpp_build()
    if build is not None and any((build / "lib").glob("libllama.*")):
        return {"LLAMA_CPP_LIB_PATH": str(build / "lib")}
    staged = staged_llama_cpp_libs()
    return {"LLAMA_CPP_LIB_PATH": str(staged)} if staged is not None else {}


def staged_llama_cpp_libs(version: str | None = None) -> Path | None:
    """The libraries a CPU build of `version` (default: the installed llama-cpp-python's) staged
    before compiling llama-server (`VERSION.lib`, complete once its lib.json is there), else None.
    Kept after the build: a console that exported this path while the build ran still finds it."""
    version = llama_cpp_python_version() if version is None else version
    if not version:
        return None
    staged = cache_dir() / "llama.cpp" / f"{version}.lib"
    if (staged / "lib.json").is_file() and any(staged.glob("libllama.*")):
        return staged
    return None


def export_llama_cpp_lib_path() -> None:
    """Put LLAMA_CPP_LIB_PATH into this process's environment when llama-cpp-python needs it, so
    every child inherits it: backends, the probe below, tests' and benchmarks' own servers."""
    os.environ.update(llama_cpp_lib_env())


def probe_llama_server(binary: str | None = None) -> dict[str, Any]:
    """llama-server (XGEN_LLAMA_SERVER_BIN, else PATH, else the cached build): version from
    `--version`; flavour from its output, linked libs, or the backend libraries beside it
    (builds that load ggml backends at run time)."""
    source = "given"
    path = binary
    if not path:
        path, source = find_llama_server()
    if not path:
        state = llama_cpp_build_state()
        if state is not None and state.prefix is not None:
            return _build_row("llama-server", state, str(state.prefix / "bin" / "llama-server"))
        return backend_row("llama-server", available=False,
                           reason="llama-server: not found (XGEN_LLAMA_SERVER_BIN, PATH, or the build "
                                  "deploy/build_llama_cpp.sh caches)")
    if not os.access(path, os.X_OK):
        return backend_row("llama-server", available=False, path=path,
                           reason=f"llama-server: {path} (from {source}) is not an executable file")
    output = _run([path, "--version"])
    version = parse_llama_server_version(output)
    if not output.strip():
        return backend_row("llama-server", available=False, path=path,
                           reason="llama-server: `--version` failed or timed out")
    evidence = output
    if flavour_from_text(evidence) == "cpu":
        evidence += "\n" + _run(["ldd", path])
        here = Path(path).resolve().parent
        evidence += "\n" + " ".join(p.name for p in [*here.glob("libggml-*"), *(here.parent / "lib").glob("libggml-*")])
    return backend_row("llama-server", available=True, version=version, flavour=flavour_from_text(evidence),
                       path=path)


def _installed(package: str) -> bool:
    try:
        importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def probe_vllm() -> dict[str, Any]:
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


def probe_llama_cpp_python() -> dict[str, Any]:
    """llama-cpp-python: importable, its version, and the ggml backend libraries it ships."""
    package_dir = _llama_cpp_package()
    if package_dir is None:
        return backend_row("llama-cpp-python", available=False, reason="llama-cpp-python: not installed")
    version = llama_cpp_python_version()
    lib_env = llama_cpp_lib_env()
    if not lib_env and not os.environ.get("LLAMA_CPP_LIB_PATH") and not _own_llama_lib(package_dir):
        state = llama_cpp_build_state(version)  # its libllama is the build's: no import can work yet
        if state is not None:
            return _build_row("llama-cpp-python", state, str(package_dir))
    lib_dir = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or lib_env.get("LLAMA_CPP_LIB_PATH") or package_dir / "lib")
    # Imported in a child process: proves libllama loads here without putting it (or a crash
    # of a mismatched GPU build) into the agent.
    try:
        check = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, text=True,
                               timeout=PROBE_TIMEOUT_S * 3, stdin=subprocess.DEVNULL, errors="replace",
                               env={**os.environ, **lib_env})
        failure = check.stderr.strip().splitlines()[-1] if check.returncode else ""
        failure = failure or (f"exit code {check.returncode}" if check.returncode else "")
    except subprocess.TimeoutExpired:
        failure = "import timed out"
    if failure:
        return backend_row("llama-cpp-python", available=False, version=version, path=str(package_dir),
                           reason=f"llama-cpp-python: import failed: {failure}")
    libs = " ".join(p.name for p in lib_dir.glob("*"))
    return backend_row("llama-cpp-python", available=True, version=version, flavour=flavour_from_text(libs),
                       path=str(package_dir))


PROBES = {
    "vllm": probe_vllm,
    "llama-server": probe_llama_server,
    "llama-cpp-python": probe_llama_cpp_python,
}


def probe_backends() -> list[dict[str, Any]]:
    """Every backend's availability on this node (see the module docstring for the shape)."""
    export_llama_cpp_lib_path()  # a build that finished since the last probe: backends inherit its path
    rows = []
    for name, probe in PROBES.items():
        try:
            rows.append(probe())
        except Exception as exc:  # one broken install must not hide the others
            rows.append(backend_row(name, available=False, reason=f"{name}: probe failed: {exc}"))
    return rows
