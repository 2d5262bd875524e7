"""A llama.cpp build seen from the console (issue 28 #1): `deploy/build_llama_cpp.sh` leaves a
state file while it compiles and one after it failed; the console reads CMake's own progress and
tells a running build from a dead one. The script runs for real here, on a source package whose
compile the test holds and releases (tests.hardware.fake_build)."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from hardware.backends import probe_backends, probe_llama_server
from hardware.llama_build import build_percent, build_state
from tests.hardware.fake_build import start_build, stub_build, wait_for, write_sdist

VERSION = "9.9.9"

# Lines as CMake's Makefile generator prints them for llama.cpp (from a real build log), then ninja's.
MAKE_LOG = """[  1%] Building C object ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o
[ 12%] Building CXX object ggml/src/CMakeFiles/ggml-cpu.dir/ggml-cpu/amx/mmq.cpp.o
[ 15%] Building CXX object ggml/src/CMakeFiles/ggml-cpu.dir/ggml-cpu/unary-ops.cpp.o
[ 14%] Building CXX object ggml/src/CMakeFiles/ggml-cpu.dir/ggml-cpu/binary-ops.cpp.o
/tmp/x.cpp:12:5: warning: unused variable 'n' [-Wunused-variable]
"""


@pytest.mark.parametrize("text, percent", [
    (MAKE_LOG, 15),  # parallel jobs print out of order: the largest
    ("[37/120] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o\n", 30),
    ("-- Configuring done\n", None),
    ("", None),
    ("[100%] Built target llama-server\n", 100),
])
def test_the_progress_is_cmakes_own(tmp_path, text, percent):
    log = tmp_path / "build.log"
    log.write_text(text)
    assert build_percent(log) == percent


def test_only_the_end_of_a_long_log_is_read(tmp_path):
    log = tmp_path / "build.log"
    log.write_text("[ 99%] early\n" + "x" * 20000 + "\n[ 40%] Building CXX object late.cpp.o\n")
    assert build_percent(log) == 40
    assert build_percent(tmp_path / "missing.log") is None


def test_a_state_file_of_a_pid_that_is_not_the_build_counts_as_failed(tmp_path):
    root = tmp_path / "llama.cpp"
    root.mkdir()
    # our own pid is alive, but it is no build script: a pid reused after a killed build
    (root / f"{VERSION}.building").write_text(json.dumps({"pid": os.getpid(), "commit": "abc", "log": "x"}))
    state = build_state(root, VERSION)
    assert state.state == "failed" and "stopped without finishing" in state.error
    (root / VERSION).mkdir()
    (root / VERSION / "build.json").write_text("{}")  # a later build finished: nothing to say
    assert build_state(root, VERSION) is None


@pytest.fixture
def cache(tmp_path, settings) -> Path:
    settings.CACHE_DIR = tmp_path / "cache"
    write_sdist(settings.CACHE_DIR, VERSION)
    return settings.CACHE_DIR


@pytest.mark.slow  # cmake configures a project, twice
def test_the_script_says_it_builds_then_leaves_a_build(cache, tmp_path):
    go, lib_go = tmp_path / "go", tmp_path / "lib-go"
    proc = start_build(cache, VERSION, go=go, lib_go=lib_go, copy_from=stub_build(tmp_path / "stub"))
    staged = cache / "llama.cpp" / f"{VERSION}.lib"
    try:
        # first the libraries (libllama and ggml's), in a log of their own
        state = wait_for(lambda: (s := build_state(cache / "llama.cpp", VERSION)) and s.percent == 20 and s,
                         what="the build's state file and the libraries' progress")
        assert state.state == "building" and state.phase == "libraries" and state.libs is None
        assert state.label == f"llama.cpp {VERSION} building: libraries 20 %, then llama-server"
        assert state.to_json()["libraries_ready"] is False and not staged.exists()
        lib_go.touch()
        # then llama-server, the libraries staged for llama-cpp-python meanwhile
        state = wait_for(lambda: (s := build_state(cache / "llama.cpp", VERSION)) and s.percent == 45 and s,
                         what="llama-server's progress")
        assert state.phase == "llama-server" and state.libs == staged, state
        assert state.label == f"llama.cpp {VERSION} building: llama-server 45 % (its libraries are ready)"
        assert state.to_json()["libraries_ready"] is True
        assert (staged / "libllama.so").is_file()
        assert json.loads((staged / "lib.json").read_text())["llama_cpp_python"] == VERSION
        # read from CMake's "-- llama.cpp version: 0.5.0-dev", as llama-server --version will say it
        assert state.llama_server_version == "0.5.0-dev (build 0, commit unknown)"
        go.touch()
        assert proc.wait(timeout=120) == 0, (cache / f"build-{VERSION}.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert build_state(cache / "llama.cpp", VERSION) is None
    assert not (cache / "llama.cpp" / f"{VERSION}.building").exists()
    assert json.loads((cache / "llama.cpp" / VERSION / "build.json").read_text())["llama_cpp_python"] == VERSION
    assert (staged / "lib.json").is_file()  # kept: a console that exported its path still finds it


@pytest.mark.slow  # cmake configures a project
def test_a_failed_compile_is_kept_with_its_error_until_a_build_succeeds(cache, tmp_path):
    go = tmp_path / "go"
    go.touch()
    proc = start_build(cache, VERSION, go=go, copy_from=stub_build(tmp_path / "stub"), fail="boom")
    assert proc.wait(timeout=120) == 1
    state = build_state(cache / "llama.cpp", VERSION)
    assert state.state == "failed" and state.error == "compiling llama-server failed"
    assert "error: boom" in json.loads((cache / "llama.cpp" / f"{VERSION}.failed").read_text())["tail"]
    assert not (cache / "llama.cpp" / f"{VERSION}.building").exists()
    proc = start_build(cache, VERSION, go=go, copy_from=stub_build(tmp_path / "stub"))
    assert proc.wait(timeout=120) == 0
    assert build_state(cache / "llama.cpp", VERSION) is None
    assert not (cache / "llama.cpp" / f"{VERSION}.failed").exists()


@pytest.mark.slow  # cmake configures a project
def test_a_build_killed_outright_is_not_shown_as_building(cache, tmp_path):
    proc = start_build(cache, VERSION, go=tmp_path / "never", copy_from=stub_build(tmp_path / "stub"))
    wait_for(lambda: build_state(cache / "llama.cpp", VERSION), what="the build's state file")
    os.killpg(proc.pid, signal.SIGKILL)  # no trap runs: the state file stays
    proc.wait()
    assert (cache / "llama.cpp" / f"{VERSION}.building").exists()
    state = wait_for(lambda: (s := build_state(cache / "llama.cpp", VERSION)) and s.state == "failed" and s,
                     what="the dead build seen as failed")
    assert "stopped without finishing" in state.label


@pytest.mark.slow  # cmake configures a project
def test_the_probe_shows_the_build_in_the_llama_cpp_rows(cache, tmp_path, monkeypatch, settings):
    """While the build of the installed llama-cpp-python's version makes the libraries, neither
    llama.cpp engine is available and both rows carry the build; llama-server's row already names
    its path and version. Once the libraries are staged, llama-cpp-python loads them (a real import
    of the real libllama) while llama-server's row still waits for the rest."""
    from importlib.metadata import version

    from hardware.backends import llama_cpp_lib_env
    from xgenconsole import settings as configured  # the CACHE_DIR before the `cache` fixture's

    installed = version("llama_cpp_python")
    real = Path(configured.CACHE_DIR) / "llama.cpp" / installed
    assert (real / "build.json").is_file(), "no cached llama.cpp build: deploy/bootstrap.sh makes one"
    write_sdist(cache, installed)
    settings.LLAMA_SERVER_BIN = ""
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    go, lib_go = tmp_path / "go", tmp_path / "lib-go"
    proc = start_build(cache, installed, go=go, lib_go=lib_go, copy_from=real)
    try:
        wait_for(lambda: (s := build_state(cache / "llama.cpp", installed)) and s.percent == 20,
                 what="the libraries' progress")
        rows = {r["name"]: r for r in probe_backends()}
        for name in ("llama-server", "llama-cpp-python"):
            assert rows[name]["available"] is False
            assert rows[name]["build"]["state"] == "building" and rows[name]["build"]["percent"] == 20, rows[name]
            assert rows[name]["build"]["phase"] == "libraries", rows[name]
            assert rows[name]["reason"] == f"{name}: llama.cpp {installed} building: libraries 20 %, then llama-server"
        assert rows["llama-server"]["path"] == str(cache / "llama.cpp" / installed / "bin" / "llama-server")
        assert rows["llama-server"]["version"] == "0.5.0-dev (build 0, commit unknown)"
        assert llama_cpp_lib_env() == {}

        lib_go.touch()
        wait_for(lambda: (s := build_state(cache / "llama.cpp", installed)) and s.percent == 45,
                 what="llama-server's progress")
        staged = cache / "llama.cpp" / f"{installed}.lib"
        assert llama_cpp_lib_env() == {"LLAMA_CPP_LIB_PATH": str(staged)}
        rows = {r["name"]: r for r in probe_backends()}
        assert rows["llama-cpp-python"]["available"] is True and "build" not in rows["llama-cpp-python"], rows
        assert rows["llama-server"]["available"] is False
        assert rows["llama-server"]["build"]["libraries_ready"] is True, rows["llama-server"]
        assert rows["llama-server"]["reason"] == (f"llama-server: llama.cpp {installed} building: llama-server 45 % "
                                                  "(its libraries are ready)")
        go.touch()
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    row = probe_llama_server()  # the real llama-server the fake compile copied (its own commit)
    assert row["available"] and row["version"].startswith("0.5.0-dev (build 0, commit ") and "build" not in row, row
    assert row["path"] == str(cache / "llama.cpp" / installed / "bin" / "llama-server")
    # the finished build's own libraries now (both copies are the same compile); the probes above
    # exported the staged path into this process, as the console's do
    assert os.environ.get("LLAMA_CPP_LIB_PATH") == str(cache / "llama.cpp" / f"{installed}.lib")
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH")
    assert llama_cpp_lib_env() == {"LLAMA_CPP_LIB_PATH": str(cache / "llama.cpp" / installed / "lib")}
