"""The S3 store vanishing in the middle of a copy into the node cache, behind a real console.

A store that cannot be reached is an outage, not a verdict on the model (issue 35 #8): the
instance waits in ERROR saying when it tries again, with the crash backoff, and reaches READY by
itself once the store is back. A store that answers "no" (an object missing) is an ERROR at once.
"""
from __future__ import annotations

import re
import time
import uuid

from tests.cluster.harness import PG_ADMIN_DSN, REDIS_HOST, _pg_admin
from tests.faults.conftest import (
    assert_timeline_chains,
    minio_env,
    open_console,
    put_in_store,
    serve_backends,
)

PREFIX = "gguf/tiny-faults"
RETRYING = re.compile(r"store unreachable, retrying in (\d+) s")
CHAT = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def _retrying_errors(events: list[dict]) -> list[int]:
    """The delays the ERROR events of a store outage announced, in order."""
    return [int(m.group(1)) for e in events if e["to_state"] == "ERROR" and (m := RETRYING.search(e["message"]))]


def _assert_outage_timeline(events: list[dict]) -> None:
    """PENDING, CACHING, then (ERROR, PENDING, CACHING) once per try, then up to READY: nothing else."""
    assert_timeline_chains(events, "READY")
    states = [e["to_state"] for e in events]
    tries = states.count("ERROR")
    assert tries >= 2, events
    assert states == ["PENDING", "CACHING"] + ["ERROR", "PENDING", "CACHING"] * tries + ["LOADING", "WARMING",
                                                                                       "READY"], states


def _cache_files(data_dir) -> list[str]:
    root = data_dir / "models" / PREFIX
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_store_vanishing_mid_copy_is_retried_and_ready_once_it_returns(tmp_path, tiny_gguf, s3, faulty_store,
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
    assert RETRYING.search(failed["state_message"]) and RETRYING.search(failed["error"]), failed
    assert failed["pid"] is None and failed["restarts"] == 0
    files = _cache_files(data)
    assert ".xgen-cache.json" not in files and not any(f.endswith(".part") for f in files), files
    assert "tiny-llama.gguf" not in files, files  # nothing half-copied passes as the model
    entry = c.shell("from hub.models import CacheEntry; e = CacheEntry.objects.get(prefix='gguf/tiny-faults'); "
                    "print(e.state, e.error[:200])")
    assert entry.startswith("FAILED "), entry
    assert serve_backends(data) == []
    deadline = time.monotonic() + 30  # a try on the dead store failed too, and the wait doubled
    while len(_retrying_errors(c.events(iid))) < 2 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _retrying_errors(c.events(iid))[:2] == [1, 2]  # XGEN_RESTART_BACKOFF=0 here: from 1 s

    faulty_store.dead = False  # the store is back; nobody clicks anything
    back_at = time.monotonic()
    ready = c.wait_instance(iid, lambda b: b["state"] == "READY", timeout=60)
    recovered_s = time.monotonic() - back_at
    assert ready["restarts"] == 0, ready  # a store outage is not a crash: no restart counted
    assert _cache_files(data) == [".xgen-cache.json", "tiny-llama.gguf"]
    assert serve_backends(data) == [ready["pid"]]
    _assert_outage_timeline(c.events(iid))
    chat = c.post("/v1/chat/completions", {"model": "tiny-store", **CHAT})
    assert chat.status_code == 200, chat.text
    print(f"\nstore loss noticed after {noticed_s:.2f} s; READY {recovered_s:.2f} s after the store came back")
    assert c.stop() == 0


def test_store_going_silent_mid_copy_is_an_error_within_the_store_timeout(tmp_path, tiny_gguf, s3, faulty_store,
                                                                         consoles):
    """A store that stops answering (a network partition, not a refused connection) must not leave
    the instance CACHING for minutes: the transfer times out after XGEN_STORE_TIMEOUT, and the
    next try (the store answers it) loads the model."""
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
    assert RETRYING.search(failed["state_message"]), failed["state_message"]
    files = _cache_files(data)
    assert ".xgen-cache.json" not in files and not any(f.endswith(".part") for f in files), files
    faulty_store.release()  # the stalled answer is let go; the store answers the next try in full
    assert c.wait_instance(iid, lambda b: b["state"] == "READY", timeout=60)["restarts"] == 0
    assert c.stop() == 0


def test_store_down_during_an_uncached_load_on_postgresql_is_retried_until_it_returns(tmp_path, tiny_gguf, s3,
                                                                                       faulty_store, consoles):
    """The issue's case, in cluster settings (PostgreSQL, Redis): the store is away before the load
    of a model this node never cached. The instance shows the retry and answers a chat once the
    store is back, without a click."""
    prefix = "gguf/tiny-uncached"
    put_in_store(s3, prefix, tiny_gguf)
    database = f"xgen_store_{uuid.uuid4().hex[:10]}"
    _pg_admin(f'CREATE DATABASE "{database}"')
    c = None
    try:
        c = open_console(tmp_path / "console", extra_env={
            **minio_env(faulty_store, s3), "DATABASE_URL": f"{PG_ADMIN_DSN.rsplit('/', 1)[0]}/{database}",
            "REDIS_URL": f"redis://{REDIS_HOST}/{1 + uuid.uuid4().int % 15}"})
        consoles.append(c)
        faulty_store.dead = True
        r = c.post("/api/management/load", {"model_path": prefix, "model_name": "tiny-uncached"})
        assert r.status_code == 202, r.text
        iid = r.json()["id"]
        failed = c.wait_instance(iid, lambda b: b["state"] == "ERROR", timeout=60)
        assert RETRYING.search(failed["state_message"]) and RETRYING.search(failed["error"]), failed
        assert prefix in failed["state_message"] and failed["pid"] is None, failed
        deadline = time.monotonic() + 30
        while len(_retrying_errors(c.events(iid))) < 2 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert _retrying_errors(c.events(iid))[:2] == [1, 2]
        assert c.instance(iid)["state"] in ("ERROR", "PENDING", "CACHING")  # still trying, never given up

        faulty_store.dead = False
        ready = c.wait_instance(iid, lambda b: b["state"] == "READY", timeout=60)
        assert ready["restarts"] == 0, ready  # a store outage is not a crash: no restart counted
        _assert_outage_timeline(c.events(iid))
        chat = c.post("/v1/chat/completions", {"model": "tiny-uncached", **CHAT})
        assert chat.status_code == 200, chat.text
        assert c.stop() == 0
    finally:
        if c is not None and c.console.proc.poll() is None:
            c.stop()
        _pg_admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def test_an_object_missing_from_the_store_is_an_error_at_once_and_not_retried(tmp_path, tiny_gguf, s3,
                                                                              faulty_store, consoles):
    """A store that answers "no such object" is not an outage: ERROR, no retry announced or made."""
    from minio import Minio

    prefix = "gguf/tiny-missing"
    put_in_store(s3, prefix, tiny_gguf)
    Minio(s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key, secure=False).remove_object(
        "xgen-faults", f"{prefix}/tiny-llama.gguf")  # the manifest names a file the store no longer holds
    c = open_console(tmp_path / "console", extra_env=minio_env(faulty_store, s3))
    consoles.append(c)
    r = c.post("/api/management/load", {"model_path": prefix, "model_name": "tiny-missing"})
    assert r.status_code == 202, r.text
    iid = r.json()["id"]
    failed = c.wait_instance(iid, lambda b: b["state"] not in ("PENDING", "CACHING"), timeout=60)
    assert failed["state"] == "ERROR" and "not in the store" in failed["state_message"], failed
    assert not RETRYING.search(failed["state_message"]) and not RETRYING.search(failed["error"]), failed
    time.sleep(4)  # past the first two retry delays (1 s, 2 s) a store outage would have used
    events = c.events(iid)
    assert [e["to_state"] for e in events] == ["PENDING", "CACHING", "ERROR"], events
    assert c.instance(iid)["state"] == "ERROR"
    assert c.stop() == 0
