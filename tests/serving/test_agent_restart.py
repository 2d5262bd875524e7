"""A real `manage.py serve` killed with -9 while a backend runs (either engine); the next agent adopts it.
The backend answers only the console (its secret, made at launch, survives the agent's restart)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from tests.conftest import start_console
from tests.procs import stop_process
from tests.serving.conftest import backend_pids, set_console_backends, wait_api

ENV = {"XGEN_RESTART_BACKOFF": "0", "XGEN_RECONCILE_INTERVAL": "1", "XGEN_STOP_GRACE": "5"}


def pid_alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def backend_secret(console, instance_id: int) -> str:
    """The instance's backend secret, as the database holds it (no API answer shows it)."""
    code = f"from serving.models import ModelInstance as M; print(M.objects.get(pk={instance_id}).backend_key)"
    return console.manage("shell", "-v", "0", "-c", code).stdout.strip()


def direct_chat(port: int, model: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """A chat request straight to the backend's port, past the console."""
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers=headers or {}, timeout=30,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})


def listen_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            address, _, hex_port = cols[1].rpartition(":")
            if cols[3] == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_agent_killed_then_restarted_adopts_the_backend(tmp_path, tiny_gguf, engine):
    data = tmp_path / "console"
    first = start_console(data, extra_env=ENV)
    try:
        set_console_backends(first)
        key = first.manage("createapikey", "--username", "admin").stdout.strip()
        r = httpx.post(f"{first.url}/api/management/load", headers={"Authorization": f"Bearer {key}"},
                       json={"model_path": str(tiny_gguf), "model_name": "tiny-adopt", "backend": engine}, timeout=10)
        assert r.status_code == 202, r.text
        url = f"{first.url}/api/management/instances/{r.json()['id']}"
        inst = wait_api(url, key, lambda b: b["state"] in ("READY", "ERROR"))
        assert inst["state"] == "READY" and inst["backend"] == engine, inst
        pid, port = inst["pid"], inst["port"]
        # Only the console talks to the backend: it listens on loopback (the embedded default) and
        # refuses a request without the instance's secret.
        assert listen_addresses(port) == {"0100007F"}, "the backend listens on 127.0.0.1 only"
        secret = backend_secret(first, inst["id"])
        assert len(secret) >= 32
        assert direct_chat(port, "tiny-adopt").status_code == 401
        assert direct_chat(port, "tiny-adopt", {"Authorization": "Bearer not-the-secret"}).status_code == 401
        direct = direct_chat(port, "tiny-adopt", {"Authorization": f"Bearer {secret}", "Origin": "http://evil.test"})
        assert direct.status_code == 200
        assert direct.headers.get("access-control-allow-origin") in ("http://evil.test", "*"), \
            "the engine itself answers any origin: what the proxy must not pass on"
        via = httpx.post(f"{first.url}/v1/chat/completions", timeout=30,
                         headers={"Authorization": f"Bearer {key}", "Origin": "http://evil.test"},
                         json={"model": "tiny-adopt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert via.status_code == 200, via.text
        assert not [h for h in via.headers if h.lower().startswith("access-control-")], dict(via.headers)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait()
    except BaseException:
        stop_process(first.proc)
        raise
    assert pid_alive(pid), "the backend outlives a killed agent (own session)"

    second = start_console(data, extra_env=ENV)
    try:
        url = f"{second.url}/api/management/instances/{inst['id']}"
        after = wait_api(url, key, lambda b: b["state"] == "READY" and "adopted" in b["state_message"], timeout=30)
        assert after["pid"] == pid and after["port"] == port and after["restarts"] == 0
        assert backend_pids("tiny-adopt", port) == [pid], "exactly one backend process for the instance"
        # The secret outlived the agent: the new one reads it back, the backend still wants it.
        assert backend_secret(second, inst["id"]) == secret
        assert direct_chat(port, "tiny-adopt").status_code == 401
        # Clients reach the adopted backend through the console's inference proxy, by served name.
        chat = httpx.post(f"{second.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                          json={"model": "tiny-adopt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["role"] == "assistant"
        # The adopted backend is still supervised: an unload stops it although it is not our child.
        r = httpx.post(f"{second.url}/api/management/unload", headers={"Authorization": f"Bearer {key}"},
                       json={"id": inst["id"]}, timeout=10)
        assert r.status_code == 202
        stopped = wait_api(url, key, lambda b: b["state"] == "STOPPED", timeout=30)
        assert stopped["pid"] is None and stopped["port"] is None
        assert not pid_alive(pid) and backend_pids("tiny-adopt", port) == []
    finally:
        assert stop_process(second.proc, timeout=30) == 0, second.log[-3000:]
    for p in backend_pids("tiny-adopt", port):  # never leave a backend behind, even on failure
        os.kill(p, signal.SIGKILL)


def test_agent_stop_stops_backends_and_next_start_brings_them_back(tmp_path, tiny_gguf):
    data = tmp_path / "console"
    first = start_console(data, extra_env=ENV)
    try:
        set_console_backends(first)
        key = first.manage("createapikey", "--username", "admin").stdout.strip()
        r = httpx.post(f"{first.url}/api/management/load", headers={"Authorization": f"Bearer {key}"},
                       json={"model_path": str(tiny_gguf), "model_name": "tiny-auto", "autostart": True}, timeout=10)
        url = f"{first.url}/api/management/instances/{r.json()['id']}"
        inst = wait_api(url, key, lambda b: b["state"] in ("READY", "ERROR"))
        assert inst["state"] == "READY", inst
    finally:
        assert stop_process(first.proc, timeout=30) == 0
    assert not pid_alive(inst["pid"]), "SIGTERM to the agent stops its backends"
    second = start_console(data, extra_env=ENV)
    try:
        # An autostart instance is READY by the time the agent counts as started.
        url = f"{second.url}/api/management/instances/{inst['id']}"
        again = wait_api(url, key, lambda b: b["state"] in ("READY", "ERROR"), timeout=60)
        assert again["state"] == "READY" and again["pid"] != inst["pid"]
        assert backend_pids("tiny-auto", again["port"]) == [again["pid"]]
    finally:
        assert stop_process(second.proc, timeout=30) == 0
    assert not pid_alive(again["pid"])
