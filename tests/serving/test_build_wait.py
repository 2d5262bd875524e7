"""Serve while llama.cpp builds (issue 28 #1), end to end: a console started while the real
`deploy/build_llama_cpp.sh` still "compiles" (tests.hardware.fake_build holds the compile, then
puts the real cached llama-server and libraries in place) shows the build on the node API, accepts
loads, holds each PENDING saying what it waits for, then starts it by itself once its engine is
built: llama-cpp-python once the libraries are staged, llama-server once the build is done; READY,
a chat answered on each, and both llama.cpp engines available."""
from __future__ import annotations

import os
import signal
import subprocess
from importlib.metadata import version

import httpx
import pytest

from hardware.backends import llama_cpp_build
from tests.conftest import Console, KeyedConsole, start_console
from tests.hardware.fake_build import start_build, stub_build, wait_for, write_sdist
from tests.procs import stop_process
from tests.serving.conftest import wait_api


def _console_while_building(tmp_path, cache, installed) -> tuple[Console, str]:
    """A console (and an admin key) started once the build has written its state file. Its
    LLAMA_CPP_LIB_PATH is empty: llama-cpp-python has no library until the build puts one in the cache."""
    wait_for(lambda: (cache / "llama.cpp" / f"{installed}.building").exists(), what="the build to start")
    console = start_console(tmp_path / "data", extra_env={
        "XGEN_CACHE_DIR": str(cache), "LLAMA_CPP_LIB_PATH": "", "XGEN_LLAMA_SERVER_BIN": "",
        "XGEN_HARDWARE_REFRESH": "1", "PATH": "/usr/bin:/bin"})
    return console, console.manage("createapikey", "--username", "admin").stdout.strip().splitlines()[-1]


def _stop(build: subprocess.Popen, console: Console | None) -> None:
    if build.poll() is None:
        os.killpg(build.pid, signal.SIGKILL)
        build.wait()
    if console is not None:
        assert stop_process(console.proc, timeout=60) == 0, console.log[-3000:]


@pytest.mark.slow  # cmake, a console, a real llama-cpp-python and a real llama-server
def test_loads_asked_for_while_llama_cpp_builds_start_as_soon_as_their_engine_is_built(tmp_path, tiny_gguf):
    """The build makes libllama first and stages it: a load asked for meanwhile (the engine left to
    the console) goes to llama-cpp-python, which needs only those libraries, and answers while
    llama-server still compiles; a load that asks for llama-server waits for the whole build."""
    real = llama_cpp_build()
    assert real is not None, "no cached llama.cpp build: deploy/bootstrap.sh makes one"
    installed = version("llama_cpp_python")
    cache = tmp_path / "cache"
    write_sdist(cache, installed)
    go, lib_go = tmp_path / "go", tmp_path / "lib-go"
    build = start_build(cache, installed, go=go, lib_go=lib_go, copy_from=real)
    console = None
    try:
        console, key = _console_while_building(tmp_path, cache, installed)
        kc = KeyedConsole(console=console, key=key)
        label = f"llama.cpp {installed} building: libraries 20 %, then llama-server"
        nodes = wait_api(f"{kc.url}/api/hardware/nodes", key,
                         lambda b: b and (b[0].get("llama_build") or {}).get("percent") == 20)
        assert nodes[0]["llama_build"]["label"] == label and nodes[0]["llama_build"]["state"] == "building"
        assert nodes[0]["llama_build"]["phase"] == "libraries" and not nodes[0]["llama_build"]["libraries_ready"]
        assert not {"llama-server", "llama-cpp-python"} & set(nodes[0]["backends"]), nodes[0]

        r = httpx.post(f"{kc.url}/api/management/load", headers=kc.auth, timeout=30,
                       json={"model_path": str(tiny_gguf), "model_name": "first"})
        assert r.status_code == 202, r.text
        assert r.json()["backend"] == "llama-cpp-python", r.json()
        first = r.json()["id"]
        inst = wait_api(f"{kc.url}/api/management/instances/{first}", key,
                        lambda b: "waiting for the build" in (b.get("state_message") or ""))
        assert inst["state"] == "PENDING", inst
        assert label in inst["state_message"] and inst["progress_pct"] == 20, inst
        assert ("llama-server (cpu) is still building on test-node" in inst["backend_reason"]
                and "the build makes the libraries it needs first" in inst["backend_reason"]
                and f"({label}; the load starts when it is built)" in inst["backend_reason"]), inst["backend_reason"]

        lib_go.touch()  # libllama is built: the script stages it, then compiles llama-server
        inst = wait_api(f"{kc.url}/api/management/instances/{first}", key,
                        lambda b: b["state"] in ("READY", "ERROR"), timeout=120)
        assert inst["state"] == "READY", inst
        chat = httpx.post(f"{kc.url}/v1/chat/completions", headers=kc.auth, timeout=60, json={
            "model": "first", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        assert build.poll() is None  # llama-server still compiles
        server_label = f"llama.cpp {installed} building: llama-server 45 % (its libraries are ready)"
        nodes = wait_api(f"{kc.url}/api/hardware/nodes", key,
                         lambda b: (b[0].get("llama_build") or {}).get("label") == server_label
                         and "llama-cpp-python" in b[0]["backends"], timeout=30)
        assert nodes[0]["llama_build"]["libraries_ready"] is True and "llama-server" not in nodes[0]["backends"]
        wait_for(lambda: "llama-cpp-python can serve now" in console.log, what="the console's log line")

        r = httpx.post(f"{kc.url}/api/management/load", headers=kc.auth, timeout=30,
                       json={"model_path": str(tiny_gguf), "model_name": "second", "backend": "llama-server"})
        assert r.status_code == 202 and r.json()["backend"] == "llama-server", r.text
        second = r.json()["id"]
        inst = wait_api(f"{kc.url}/api/management/instances/{second}", key,
                        lambda b: "waiting for the build" in (b.get("state_message") or ""))
        assert inst["state"] == "PENDING" and server_label in inst["state_message"] and inst["progress_pct"] == 45, inst

        go.touch()  # the compile ends: the script copies the build into the cache and writes build.json
        assert build.wait(timeout=120) == 0, (cache / f"build-{installed}.log").read_text()
        inst = wait_api(f"{kc.url}/api/management/instances/{second}", key,
                        lambda b: b["state"] in ("READY", "ERROR"), timeout=120)
        assert inst["state"] == "READY", inst
        assert inst["command"][0] == str(cache / "llama.cpp" / installed / "bin" / "llama-server"), inst["command"]
        chat = httpx.post(f"{kc.url}/v1/chat/completions", headers=kc.auth, timeout=60, json={
            "model": "second", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        nodes = wait_api(f"{kc.url}/api/hardware/nodes", key,
                         lambda b: {"llama-server", "llama-cpp-python"} <= set(b[0]["backends"]), timeout=30)
        assert nodes[0]["llama_build"] is None
        assert "the build ended; backends" in console.log, console.log[-3000:]
        for pk in (first, second):
            httpx.post(f"{kc.url}/api/management/unload", headers=kc.auth, json={"id": pk}, timeout=10)
        for pk in (first, second):
            wait_api(f"{kc.url}/api/management/instances/{pk}", key, lambda b: b["state"] == "STOPPED", timeout=60)
    finally:
        _stop(build, console)


@pytest.mark.slow  # cmake and a console
def test_a_load_waiting_for_a_build_that_fails_ends_in_error_with_the_builds_error(tmp_path, tiny_gguf):
    installed = version("llama_cpp_python")
    cache = tmp_path / "cache"
    write_sdist(cache, installed)
    go = tmp_path / "go"
    # the libraries (a stub's, which no llama-cpp-python can load) are staged; llama-server fails
    build = start_build(cache, installed, go=go, copy_from=stub_build(tmp_path / "stub"), fail="no space left on device")
    console = None
    try:
        console, key = _console_while_building(tmp_path, cache, installed)
        url = console.url
        wait_api(f"{url}/api/hardware/nodes", key, lambda b: b and b[0].get("llama_build"))
        r = httpx.post(f"{url}/api/management/load", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                       json={"model_path": str(tiny_gguf), "model_name": "never", "backend": "llama-server"})
        assert r.status_code == 202, r.text
        pk = r.json()["id"]
        wait_api(f"{url}/api/management/instances/{pk}", key, lambda b: "waiting for the build" in (b.get("state_message") or ""))
        go.touch()
        assert build.wait(timeout=120) == 1
        inst = wait_api(f"{url}/api/management/instances/{pk}", key, lambda b: b["state"] == "ERROR", timeout=60)
        assert f"llama.cpp {installed} build failed: compiling llama-server failed" in inst["state_message"], inst
        nodes = wait_api(f"{url}/api/hardware/nodes", key,
                         lambda b: (b[0].get("llama_build") or {}).get("state") == "failed")
        assert nodes[0]["llama_build"]["error"] == "compiling llama-server failed"
        # and the console's own log (the terminal of `bootstrap.sh run`) says it
        assert f"llama.cpp {installed} building" in console.log, console.log[-3000:]
        assert f"llama.cpp {installed} build failed: compiling llama-server failed on test-node" in console.log
        # a new load is refused at once: nothing builds any more
        r = httpx.post(f"{url}/api/management/load", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                       json={"model_path": str(tiny_gguf), "model_name": "never2"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "backend_unavailable", r.text
    finally:
        _stop(build, console)
