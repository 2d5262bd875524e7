"""Backend availability probe: recorded llama-server outputs, and the real probe here."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hardware import backends
from hardware.backends import (
    flavour_from_text,
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


def test_llama_server_absent_from_path_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    row = probe_llama_server()
    assert row == {"name": "llama-server", "available": False, "version": "", "flavour": "", "path": "",
                   "reason": "llama-server: not found on PATH"}


def test_the_real_probe_here():
    rows = probe_backends()
    assert [r["name"] for r in rows] == ["vllm", "llama-server", "llama-cpp-python"]
    assert all(set(r) == KEYS for r in rows)
    by_name = {r["name"]: r for r in rows}
    lcp = by_name["llama-cpp-python"]
    assert lcp["available"] is True and lcp["flavour"] == "cpu" and lcp["reason"] == ""
    assert lcp["version"].count(".") == 2 and os.path.isdir(lcp["path"])
    for row in rows:
        assert row["available"] or row["reason"].startswith(row["name"] + ":")


def test_a_llama_cpp_python_that_cannot_load_its_library_is_unavailable(tmp_path, monkeypatch):
    # What a CUDA build of llama-cpp-python does on a node without the CUDA runtime.
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(
        'raise OSError("libcudart.so.12: cannot open shared object file: No such file or directory")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    row = backends.probe_llama_cpp_python()
    assert row["available"] is False and row["path"] == str(tmp_path / "llama_cpp")
    assert row["reason"] == ("llama-cpp-python: import failed: OSError: libcudart.so.12: cannot open shared "
                             "object file: No such file or directory")
