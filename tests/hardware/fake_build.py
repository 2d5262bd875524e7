"""A llama-cpp-python source package whose "compile" the test controls, for the real
deploy/build_llama_cpp.sh: CMake configures it and builds its `llama` target (the libraries:
CMake-style progress, then, once the test's lib-go file exists when it gives one, the libraries
copied from `FAKE_FROM`), then its `llama-server` target, which prints progress, waits for the
test's go file, then fails or puts in place a llama-server (and the libraries) copied from
`FAKE_FROM` (the real cached build, or a stub). Everything around the compile (the state files,
the staged libraries, the copy into the cache, build.json) is the script's own."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from tests.conftest import REPO

CMAKELISTS = """cmake_minimum_required(VERSION 3.14)
project(fake_llama NONE)
message(STATUS "llama.cpp version: 0.5.0-dev")
add_custom_target(llama COMMAND sh ${CMAKE_SOURCE_DIR}/compile-lib.sh ${CMAKE_BINARY_DIR})
add_custom_target(llama-server ALL COMMAND sh ${CMAKE_SOURCE_DIR}/compile.sh ${CMAKE_BINARY_DIR})
"""
COMPILE_LIB = """set -e
echo "[ 20%] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o"
if [ -n "$FAKE_LIB_GO" ]; then while [ ! -e "$FAKE_LIB_GO" ]; do sleep 0.1; done; fi
mkdir -p "$1/bin"
cp "$FAKE_FROM"/lib/lib*.so* "$1/bin/"
echo "[100%] Built target llama"
"""
COMPILE = """set -e
echo "[ 12%] Building CXX object ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o"
echo "[ 45%] Building CXX object tools/server/CMakeFiles/llama-server.dir/server.cpp.o"
while [ ! -e "$FAKE_GO" ]; do sleep 0.1; done
if [ -n "$FAKE_FAIL" ]; then echo "server.cpp:1:1: error: $FAKE_FAIL"; exit 1; fi
mkdir -p "$1/bin"
cp "$FAKE_FROM/bin/llama-server" "$1/bin/"
cp "$FAKE_FROM"/lib/lib*.so* "$1/bin/" 2>/dev/null || true
echo "[100%] Built target llama-server"
"""
STUB_SERVER = "#!/bin/sh\necho 'version: 0.5.0-dev (build 0, commit unknown)'\necho 'built with cc for x86_64-linux-gnu'\n"


def _add(tar: tarfile.TarFile, name: str, text: str, mode: int = 0o644) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def write_sdist(cache: Path, version: str) -> Path:
    """The fake source package where the script looks for it first (no download)."""
    path = cache / "sdist" / f"llama_cpp_python-{version}.tar.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    root = f"llama_cpp_python-{version}/vendor/llama.cpp"
    with tarfile.open(path, "w:gz") as tar:
        _add(tar, f"{root}/CMakeLists.txt", CMAKELISTS)
        _add(tar, f"{root}/compile.sh", COMPILE)
        _add(tar, f"{root}/compile-lib.sh", COMPILE_LIB)
        _add(tar, f"{root}/tools/server/server.cpp", "int main() { return 0; }\n")
        _add(tar, f"{root}/LICENSE", "MIT\n")
    return path


def stub_build(where: Path) -> Path:
    """A `FAKE_FROM` with a llama-server that only answers --version."""
    (where / "bin").mkdir(parents=True, exist_ok=True)
    (where / "lib").mkdir(exist_ok=True)
    server = where / "bin" / "llama-server"
    server.write_text(STUB_SERVER)
    server.chmod(0o755)
    (where / "lib" / "libllama.so").write_bytes(b"")
    return where


def start_build(cache: Path, version: str, *, go: Path, copy_from: Path, fail: str = "",
                lib_go: Path | None = None) -> subprocess.Popen:
    """The real build script on the fake source package, in its own session (as bootstrap runs it).
    `lib_go`: the libraries' phase waits for this file (without it, it does not wait)."""
    env = {**os.environ, "XGEN_CACHE_DIR": str(cache), "FAKE_GO": str(go), "FAKE_FROM": str(copy_from),
           "FAKE_FAIL": fail, "XGEN_BUILD_JOBS": "1", "FAKE_LIB_GO": str(lib_go or "")}
    cache.mkdir(parents=True, exist_ok=True)
    log = (cache / f"build-{version}.log").open("wb")
    return subprocess.Popen(["bash", str(REPO / "deploy" / "build_llama_cpp.sh"), version, sys.executable],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(predicate, *, timeout: float = 60, what: str = "") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
