"""The S3 store vanishing in the middle of a copy into the node cache, behind a real console."""
from __future__ import annotations

import time

from tests.faults.conftest import (
    assert_timeline_chains,
    minio_env,
    open_console,
    put_in_store,
    serve_backends,
)

PREFIX = "gguf/tiny-faults"


def _cache_files(data_dir) -> list[str]:
    root = data_dir / "models" / PREFIX
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_store_vanishing_mid_copy_is_an_error_and_a_restart_recovers(tmp_path, tiny_gguf, s3, faulty_store,
                                                                      consoles):
    put_in_store(s3, PREFIX, tiny_gguf)
    data = tmp_path / "console"
    c = open_console(data, extra_env=minio_env(faulty_store, s3))
    consoles.append(c)
    faulty_store.hold("tiny-llama.gguf", after_bytes=128 * 1024)
    r = c.post("/api/management/load", {"model_path": PREFIX, "model_name": "tiny-store"})
    assert r.status_code == 202, r.text
    iid = r.json()["id"]
    assert faulty_store.holding.wait(60), "the copy never reached the model file"
    caching = c.wait_instance(iid, lambda b: b["state"] == "CACHING")
    assert caching["pid"] is None
    faulty_store.dead = True  # the store goes away with the copy half done
    faulty_store.release()
    lost_at = time.monotonic()
    failed = c.wait_instance(iid, lambda b: b["state"] not in ("CACHING", "PENDING"), timeout=60)
    noticed_s = time.monotonic() - lost_at
    assert failed["state"] == "ERROR", failed
    store_name = f"s3://{faulty_store.endpoint}/xgen-faults"
    assert PREFIX in failed["state_message"] and store_name in failed["state_message"], failed["state_message"]
    assert failed["error"] and failed["pid"] is None and failed["restarts"] == 0
    files = _cache_files(data)
    assert ".xgen-cache.json" not in files and not any(f.endswith(".part") for f in files), files
    assert "tiny-llama.gguf" not in files, files  # nothing half-copied passes as the model
    entry = c.shell("from hub.models import CacheEntry; e = CacheEntry.objects.get(prefix='gguf/tiny-faults'); "
                    "print(e.state, e.error[:200])")
    assert entry.startswith("FAILED "), entry
    assert serve_backends(data) == []

    faulty_store.dead = False  # the store is back
    r = c.post("/api/management/restart", {"id": iid})
    assert r.status_code == 202, r.text
    back_at = time.monotonic()
    ready = c.wait_instance(iid, lambda b: b["state"] in ("READY", "ERROR"), timeout=60)
    recovered_s = time.monotonic() - back_at
    assert ready["state"] == "READY", ready
    assert _cache_files(data) == [".xgen-cache.json", "tiny-llama.gguf"]
    assert serve_backends(data) == [ready["pid"]]
    events = c.events(iid)
    assert_timeline_chains(events, "READY")
    assert [e["to_state"] for e in events] == ["PENDING", "CACHING", "ERROR", "PENDING", "CACHING", "LOADING",
                                               "WARMING", "READY"], events
    chat = c.post("/v1/chat/completions", {"model": "tiny-store", "max_tokens": 2,
                                           "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    print(f"\nstore loss noticed after {noticed_s:.2f} s; READY {recovered_s:.2f} s after the restart request")
    assert c.stop() == 0


def test_store_going_silent_mid_copy_is_an_error_within_the_store_timeout(tmp_path, tiny_gguf, s3, faulty_store,
                                                                         consoles):
    """A store that stops answering (a network partition, not a refused connection) must not leave
    the instance CACHING for minutes: the transfer times out after XGEN_STORE_TIMEOUT."""
    put_in_store(s3, PREFIX, tiny_gguf)
    data = tmp_path / "console"
    c = open_console(data, extra_env={**minio_env(faulty_store, s3), "XGEN_STORE_TIMEOUT": "2"})
    consoles.append(c)
    faulty_store.hold("tiny-llama.gguf", after_bytes=128 * 1024)  # and never released: silence
    r = c.post("/api/management/load", {"model_path": PREFIX, "model_name": "tiny-silent"})
    assert r.status_code == 202, r.text
    iid = r.json()["id"]
    assert faulty_store.holding.wait(60), "the copy never reached the model file"
    failed = c.wait_instance(iid, lambda b: b["state"] not in ("CACHING", "PENDING"), timeout=60)
    assert failed["state"] == "ERROR", failed
    assert f"s3://{faulty_store.endpoint}/xgen-faults" in failed["state_message"], failed["state_message"]
    assert "timed out" in failed["state_message"].lower(), failed["state_message"]
    files = _cache_files(data)
    assert ".xgen-cache.json" not in files and not any(f.endswith(".part") for f in files), files
    faulty_store.release()
    r = c.post("/api/management/restart", {"id": iid})
    assert r.status_code == 202, r.text
    assert c.wait_instance(iid, lambda b: b["state"] in ("READY", "ERROR"), timeout=60)["state"] == "READY"
    assert c.stop() == 0
