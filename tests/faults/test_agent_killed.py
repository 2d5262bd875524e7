"""The console (web + node agent in one process) killed with -9 while an instance loads, then
started again on the same data dir: the instance ends READY with one backend and a timeline
that says what happened."""
from __future__ import annotations

import os
import time

from tests.faults.conftest import (
    assert_timeline_chains,
    backend_pids,
    minio_env,
    open_console,
    put_in_store,
    serve_backends,
)
from tests.procs import pid_alive

PREFIX = "gguf/tiny-agent-kill"

# Holds a llama-cpp-python backend at start-up while the gate file exists: a LOADING window as
# wide as the test needs, with the backend's pid already recorded.
GATE_SITE = """
import os, sys, time
gate = os.environ.get("XGEN_FAULTS_BACKEND_GATE", "")
if gate and "llama_cpp.server" in sys.orig_argv:
    while os.path.exists(gate):
        time.sleep(0.05)
"""


def gated_backend_env(tmp_path, **extra: str) -> tuple:
    """The gate file that holds backends back while it exists (GATE_SITE, put on PYTHONPATH), and
    the console environment that installs it, with `extra` settings added."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(GATE_SITE)
    gate = tmp_path / "backend-gate"
    gate.touch()
    env = {"PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "XGEN_FAULTS_BACKEND_GATE": str(gate), **extra}
    return gate, env


def _cache_state(c, prefix: str) -> str:
    return c.shell(f"from hub.models import CacheEntry; print(CacheEntry.objects.get(prefix={prefix!r}).state)")


def test_agent_killed_while_caching_resumes_to_ready(tmp_path, tiny_gguf, s3, faulty_store, consoles):
    put_in_store(s3, PREFIX, tiny_gguf)
    data = tmp_path / "console"
    env = minio_env(faulty_store, s3)
    first = open_console(data, extra_env=env)
    consoles.append(first)
    faulty_store.hold("tiny-llama.gguf", after_bytes=128 * 1024)
    r = first.post("/api/management/load", {"model_path": PREFIX, "model_name": "tiny-cache-kill"})
    assert r.status_code == 202, r.text
    iid = r.json()["id"]
    assert faulty_store.holding.wait(60), "the copy never reached the model file"
    assert first.wait_instance(iid, lambda b: b["state"] == "CACHING")["pid"] is None
    first.kill()
    killed_at = time.monotonic()
    faulty_store.release()
    part = data / "models" / PREFIX / "tiny-llama.gguf.part"
    assert part.exists(), "the killed sync left its partial file (the next sync must not trust it)"

    second = open_console(data, extra_env=env, key=first.key)
    consoles.append(second)
    ready = second.wait_instance(iid, lambda b: b["state"] in ("READY", "ERROR"), timeout=60)
    recovered_s = time.monotonic() - killed_at
    assert ready["state"] == "READY", ready
    assert ready["restarts"] == 0
    assert serve_backends(data) == [ready["pid"]] == backend_pids("tiny-cache-kill", ready["port"])
    assert not part.exists()
    assert (data / "models" / PREFIX / "tiny-llama.gguf").read_bytes() == tiny_gguf.read_bytes()
    assert _cache_state(second, PREFIX) == "READY"
    events = second.events(iid)
    assert_timeline_chains(events, "READY")
    interrupted = [e for e in events if e["from_state"] == "CACHING" and "agent" in e["message"]]
    assert len(interrupted) == 1 and interrupted[0]["to_state"] == "PENDING", events
    after = events[events.index(interrupted[0]):]
    assert [e["to_state"] for e in after] == ["PENDING", "CACHING", "LOADING", "WARMING", "READY"], after
    print(f"\nkilled while CACHING: READY {recovered_s:.2f} s after the kill (console restart included)")
    assert second.stop() == 0
    assert serve_backends(data) == []


def test_agent_killed_while_loading_leaves_no_orphan(tmp_path, tiny_gguf, consoles):
    gate, env = gated_backend_env(tmp_path)
    data = tmp_path / "console"
    first = open_console(data, extra_env=env)
    consoles.append(first)
    r = first.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "tiny-load-kill"})
    assert r.status_code == 202, r.text
    iid = r.json()["id"]
    loading = first.wait_instance(iid, lambda b: b["state"] == "LOADING" and b["pid"])
    orphan = loading["pid"]
    first.kill()
    killed_at = time.monotonic()
    assert pid_alive(orphan), "the backend outlives the killed agent (its own session)"
    gate.unlink()  # the orphan finishes loading on its own: healthy, but nobody's

    second = open_console(data, extra_env=env, key=first.key)
    consoles.append(second)
    ready = second.wait_instance(iid, lambda b: b["state"] in ("READY", "ERROR"), timeout=60)
    recovered_s = time.monotonic() - killed_at
    assert ready["state"] == "READY", ready
    assert not pid_alive(orphan), "the first run's backend is gone"
    assert ready["pid"] != orphan
    assert serve_backends(data) == [ready["pid"]] == backend_pids("tiny-load-kill", ready["port"])
    events = second.events(iid)
    assert_timeline_chains(events, "READY")
    stopped = [e for e in events if e["from_state"] == "LOADING" and "agent" in e["message"]]
    assert len(stopped) == 1 and str(orphan) in stopped[0]["message"], events
    after = events[events.index(stopped[0]):]
    assert [e["to_state"] for e in after][-3:] == ["LOADING", "WARMING", "READY"], after
    print(f"\nkilled while LOADING: READY {recovered_s:.2f} s after the kill (console restart included)")
    assert second.stop() == 0
    assert serve_backends(data) == []
