"""Backend availability probe: recorded llama-server outputs, where llama-server and libllama come
from (XGEN_LLAMA_SERVER_BIN, PATH, the cached build), and the real probe here."""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from hardware import backends
from hardware.backends import (
    find_llama_server,
    flavour_from_text,
    llama_cpp_lib_env,
    parse_llama_server_version,
    probe_backends,
    probe_llama_server,
)
from tests.hardware import recorded

KEYS = {"name", "available", "version", "flavour", "path", "reason"}


@pytest.mark.parametrize(("output", "flavour", "version"), [
    (recorded.LLAMA_SERVER_CUDA, "cuda", "4880 (2c9f833d)"),
    (recorded.LLAMA_SERVER_ROCM, "rocm", "5002 (d5a4bc1a)"),
    (recorded.LLAMA_SERVER_VULKAN, "vulkan", "5123 (0f2bbe65)"),
    (recorded.LLAMA_SERVER_CPU, "cpu", "6080 (a0552c8b)"),
    (recorded.LLAMA_SERVER_DYNAMIC_CUDA, "cuda", "6123 (79c1160b)"),
])
def test_llama_server_version_output_is_parsed(output, flavour, version):
    assert flavour_from_text(output) == flavour
    assert parse_llama_server_version(output) == version


def test_the_semantic_version_format_is_parsed_and_counts_as_current():
    # llama.cpp 0.5 (what deploy/build_llama_cpp.sh builds from a source package: build 0 = unknown).
    out = "version: 0.5.0-dev (build 0, commit 0c1e570)\nbuilt with GNU 12.2.0 for Linux x86_64\n"
    assert parse_llama_server_version(out) == "0.5.0-dev (build 0, commit 0c1e570)"
    assert flavour_from_text(out) == "cpu"
    from serving.adapters.llama_server import LlamaServer

    for version in ("0.5.0-dev (build 0, commit 0c1e570)", "0.5.1 (build 9001, commit 1a2b3c4d)", "0 (unknown)",
                    "6325 (aa11bb22)"):
        assert LlamaServer().allowed_flags(version)["--flash-attn"] == "choice:on|off|auto", version
    assert LlamaServer().allowed_flags("6080 (a0552c8b)")["--flash-attn"] == "bool"


def test_linked_libraries_name_the_flavour():
    assert flavour_from_text(recorded.LDD_ROCM) == "rocm"
    assert flavour_from_text("libggml-base.so libggml-cpu.so libllama.so") == "cpu"
    assert flavour_from_text("libggml-vulkan.so libggml-cpu.so") == "vulkan"


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_a_llama_server_binary_is_probed_for_real(tmp_path):
    # An executable on disk that answers --version like a ROCm build (stderr, as llama.cpp does).
    (tmp_path / "recorded.txt").write_text(recorded.LLAMA_SERVER_ROCM)
    binary = _script(tmp_path / "llama-server", f'cat "{tmp_path}/recorded.txt" >&2\n')
    row = probe_llama_server(str(binary))
    assert row == {"name": "llama-server", "available": True, "version": "5002 (d5a4bc1a)", "flavour": "rocm",
                   "path": str(binary), "reason": ""}


def test_a_cpu_build_with_backend_libraries_beside_it_takes_their_flavour(tmp_path):
    (tmp_path / "recorded.txt").write_text(recorded.LLAMA_SERVER_CPU)
    binary = _script(tmp_path / "llama-server", f'cat "{tmp_path}/recorded.txt"\n')
    (tmp_path / "libggml-vulkan.so").write_bytes(b"")
    assert probe_llama_server(str(binary))["flavour"] == "vulkan"


def test_a_hanging_llama_server_is_cut_off(tmp_path, monkeypatch):
    monkeypatch.setattr(backends, "PROBE_TIMEOUT_S", 0.5)
    binary = _script(tmp_path / "llama-server", "exec sleep 30\n")
    row = probe_llama_server(str(binary))
    assert row["available"] is False and "timed out" in row["reason"]


def test_llama_server_absent_everywhere_says_where_it_looked(monkeypatch, tmp_path, settings):
    monkeypatch.setenv("PATH", str(tmp_path))
    settings.LLAMA_SERVER_BIN = ""
    settings.CACHE_DIR = tmp_path / "empty-cache"
    row = probe_llama_server()
    assert row == {"name": "llama-server", "available": False, "version": "", "flavour": "", "path": "",
                   "reason": "llama-server: not found (XGEN_LLAMA_SERVER_BIN, PATH, or the build "
                             "deploy/build_llama_cpp.sh caches)"}


def _cached_build(cache: Path, version: str, output: str) -> Path:
    """A build as deploy/build_llama_cpp.sh leaves it (a script answers for the binary)."""
    build = cache / "llama.cpp" / version
    (build / "bin").mkdir(parents=True)
    (build / "lib").mkdir()
    (build / "lib" / "libllama.so").write_bytes(b"")
    (build / "recorded.txt").write_text(output)
    _script(build / "bin" / "llama-server", f'/bin/cat "{build}/recorded.txt"\n')
    (build / "build.json").write_text(json.dumps({"llama_cpp_python": version, "flavour": "cpu"}))
    return build


def test_llama_server_comes_from_the_setting_then_path_then_the_cached_build(monkeypatch, tmp_path, settings):
    monkeypatch.setattr(backends, "llama_cpp_python_version", lambda: "0.3.36")
    settings.CACHE_DIR = tmp_path / "cache"
    build = _cached_build(settings.CACHE_DIR, "0.3.36", "version: 0.5.0-dev (build 0, commit 0c1e570)\n")
    _cached_build(settings.CACHE_DIR, "0.3.35", "version: 0.5.0-dev (build 0, commit 4df29be)\n")  # another version's: never taken
    on_path = tmp_path / "path"
    on_path.mkdir()
    _script(on_path / "llama-server", f'cat "{build}/recorded.txt"\n')
    gpu_build = _script(tmp_path / "cuda-llama-server", 'echo "ggml_cuda_init: found 1 CUDA devices"; echo "version: 6123 (79c1160b)"\n')

    settings.LLAMA_SERVER_BIN = str(gpu_build)
    monkeypatch.setenv("PATH", str(on_path))
    assert find_llama_server() == (str(gpu_build), "XGEN_LLAMA_SERVER_BIN")
    row = probe_llama_server()
    assert (row["path"], row["version"], row["flavour"]) == (str(gpu_build), "6123 (79c1160b)", "cuda")

    settings.LLAMA_SERVER_BIN = ""
    assert find_llama_server() == (str(on_path / "llama-server"), "PATH")

    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert find_llama_server() == (str(build / "bin" / "llama-server"), "cache")
    row = probe_llama_server()
    assert row == {"name": "llama-server", "available": True, "version": "0.5.0-dev (build 0, commit 0c1e570)", "flavour": "cpu",
                   "path": str(build / "bin" / "llama-server"), "reason": ""}

    (build / "build.json").unlink()  # an interrupted build is no build
    assert find_llama_server() == (None, "")


def test_a_binary_named_by_the_setting_that_is_missing_is_unavailable_not_replaced(settings, tmp_path):
    settings.LLAMA_SERVER_BIN = str(tmp_path / "no-such-llama-server")
    row = probe_llama_server()
    assert row["available"] is False and row["path"] == str(tmp_path / "no-such-llama-server")
    assert "from XGEN_LLAMA_SERVER_BIN" in row["reason"] and "not an executable" in row["reason"]


def test_llama_cpp_python_without_its_own_library_gets_the_cached_one(monkeypatch, tmp_path, settings):
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    monkeypatch.setattr(backends, "llama_cpp_python_version", lambda: "0.3.36")
    settings.CACHE_DIR = tmp_path / "cache"
    build = _cached_build(settings.CACHE_DIR, "0.3.36", "version: 0.5.0-dev (build 0, commit 0c1e570)\n")
    package = tmp_path / "site" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)  # find_spec must see the stand-in, not the real one
    # Installed with CMAKE_ARGS=-DLLAMA_BUILD=OFF: no lib/ of its own.
    assert llama_cpp_lib_env() == {"LLAMA_CPP_LIB_PATH": str(build / "lib")}
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", "/opt/my-llama/lib")  # one set by hand is left alone
    assert llama_cpp_lib_env() == {}
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH")
    (package / "lib").mkdir()
    (package / "lib" / "libllama.so").write_bytes(b"")  # a wheel with its own library (CUDA, say) keeps it
    assert llama_cpp_lib_env() == {}


def test_the_real_probe_here():
    rows = probe_backends()
    assert [r["name"] for r in rows] == ["vllm", "llama-server", "llama-cpp-python"]
    assert all(set(r) == KEYS for r in rows)
    by_name = {r["name"]: r for r in rows}
    lcp = by_name["llama-cpp-python"]
    assert lcp["available"] is True and lcp["flavour"] == "cpu" and lcp["reason"] == ""
    assert lcp["version"].count(".") == 2 and os.path.isdir(lcp["path"])
    # llama-server: the CPU build deploy/build_llama_cpp.sh caches (bootstrap builds it), or one on PATH.
    server = by_name["llama-server"]
    assert server["available"] is True, server["reason"]
    assert server["flavour"] == "cpu" and server["version"] and os.access(server["path"], os.X_OK)
    for row in rows:
        assert row["available"] or row["reason"].startswith(row["name"] + ":")


def test_a_llama_cpp_python_that_cannot_load_its_library_is_unavailable(tmp_path, monkeypatch):
    # What a CUDA build of llama-cpp-python does on a node without the CUDA runtime.
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(
        'raise OSError("libcudart.so.12: cannot open shared object file: No such file or directory")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)  # find_spec must see the stand-in, not the real one
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    row = backends.probe_llama_cpp_python()
    assert row["available"] is False and row["path"] == str(tmp_path / "llama_cpp")
    assert row["reason"] == ("llama-cpp-python: import failed: OSError: libcudart.so.12: cannot open shared "
                             "object file: No such file or directory")
