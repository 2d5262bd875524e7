"""The console (web + node agent in one process) killed with -9 in the middle of a cache eviction,
then started again on the same data dir: the model's cache folder is whole or gone (never half),
the cache row agrees, nothing the eviction left remains, and a load fetches the model again.

The removal is held open, not raced: a sitecustomize in the console process (and only there) holds
the unlink of the HOLD_AT-th filler file while a gate file exists, and says so with a file of its own.
"""
from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path

import httpx

from tests.faults.conftest import FaultConsole, minio_env, open_console, put_in_store

PREFIX = "gguf/tiny-evict-kill"
NODE = "test-node"
FILLERS = 300  # small files beside the GGUF: a removal that takes many steps
HOLD_AT = 40  # 39 filler files are gone when the removal is held

HOLD_SITE = f"""
import os, sys, time
gate = os.environ.get("XGEN_FAULTS_UNLINK_GATE", "")
if gate and "serve" in sys.orig_argv:
    _unlink, _seen = os.unlink, [0]

    def _held_unlink(path, *args, **kwargs):
        name = "" if isinstance(path, int) else os.path.basename(os.fsdecode(path))
        if name.startswith("evictfill-"):
            _seen[0] += 1
            if _seen[0] == {HOLD_AT}:
                open(gate + ".holding", "w").close()
                while os.path.exists(gate):
                    time.sleep(0.05)
        return _unlink(path, *args, **kwargs)

    os.unlink = os.remove = _held_unlink
"""


def _model_dir(tmp_path: Path, tiny_gguf: Path) -> dict[str, bytes]:
    """The tiny GGUF and FILLERS small files, in a folder the store gets as PREFIX; returns them."""
    files = {"tiny-llama.gguf": tiny_gguf.read_bytes()}
    files.update({f"evictfill-{i:04d}.txt": f"filler {i}\n".encode() * 8 for i in range(FILLERS)})
    folder = tmp_path / "model"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def _hold_env(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOLD_SITE)
    gate = tmp_path / "unlink-gate"
    gate.touch()
    return gate, {"PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]),
                  "XGEN_FAULTS_UNLINK_GATE": str(gate)}


def _wait(predicate, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: never happened in {timeout:g} s")


def _cache(c: FaultConsole) -> dict:
    r = httpx.get(f"{c.url}/api/hardware/nodes/{NODE}/cache", headers=c.auth, timeout=10)
    r.raise_for_status()
    return r.json()


def _job(c: FaultConsole, job_id: int) -> dict:
    r = httpx.get(f"{c.url}/api/hardware/nodes/{NODE}/cache/jobs/{job_id}", headers=c.auth, timeout=10)
    r.raise_for_status()
    return r.json()


def _on_disk(folder: Path) -> dict[str, bytes]:
    """The model files of a cache folder (its own cache manifest aside)."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name != ".xgen-cache.json"} if folder.is_dir() else {}


def test_agent_killed_mid_eviction_leaves_the_copy_whole_or_gone(tmp_path, tiny_gguf, s3, faulty_store, consoles):
    files = _model_dir(tmp_path, tiny_gguf)
    put_in_store(s3, PREFIX, tmp_path / "model")
    data = tmp_path / "console"
    models = data / "models"
    cached = models / PREFIX
    env = minio_env(faulty_store, s3)
    gate, hold_env = _hold_env(tmp_path)
    first = open_console(data, extra_env={**env, **hold_env})
    consoles.append(first)

    r = first.post("/api/management/load", {"model_path": PREFIX, "model_name": "tiny-evict-kill"})
    assert r.status_code == 202, r.text
    iid = r.json()["id"]
    inst = first.wait_instance(iid, lambda b: b["state"] in ("READY", "ERROR"), timeout=120)
    assert inst["state"] == "READY", inst  # once ERROR in a run with other tests beside it: say why, next time
    assert _on_disk(cached) == files
    assert first.post("/api/management/unload", {"id": iid}).status_code == 202
    first.wait_instance(iid, lambda b: b["state"] == "STOPPED")

    r = first.post(f"/api/hardware/nodes/{NODE}/cache/evict", {"prefix": PREFIX})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    holding = Path(str(gate) + ".holding")
    _wait(holding.exists, "the eviction reached its files")
    trash_at_kill = {p.name: len(list(p.iterdir())) for p in (models / ".xgen-evicting").glob("*")}
    first.kill()
    restarted_at = datetime.now().astimezone()
    gate.unlink()

    second = open_console(data, extra_env=env, key=first.key)  # no hold: the restart removes freely
    consoles.append(second)
    # The agent's first pass measures the cache (and drops rows whose folder is gone): wait for it.
    view = _wait(lambda: (v := _cache(second))["measured_at"] and datetime.fromisoformat(
        v["measured_at"]) > restarted_at and v, "the restarted agent measured its cache")
    rows = {m["prefix"]: m for m in view["models"]}
    if cached.exists():  # whole and vouched for, or...
        assert _on_disk(cached) == files, (f"a half model is left where it lives: {len(_on_disk(cached))} of "
                                           f"{len(files)} files, its row {rows.get(PREFIX, {}).get('state')}")
        assert rows[PREFIX]["state"] == "READY", rows
    else:  # ...gone, and no row says otherwise
        assert PREFIX not in rows, rows
    # The eviction had moved the whole folder aside (files and cache manifest) before the first file went.
    assert list(trash_at_kill.values()) == [len(files) + 1 - (HOLD_AT - 1)], trash_at_kill
    assert not list((models / ".xgen-evicting").glob("*")), "the restart left the evicted files"
    job = _job(second, job_id)
    assert job["status"] == "FAILED" and "agent stopped" in job["error"], job

    # A load fetches the model from the store again, whole.
    assert second.post("/api/management/restart", {"id": iid}).status_code == 202
    assert second.wait_instance(iid, lambda b: b["state"] in ("READY", "ERROR"), timeout=120)["state"] == "READY"
    assert _on_disk(cached) == files
    rows = {m["prefix"]: m for m in _cache(second)["models"]}
    assert rows[PREFIX]["state"] == "READY", rows
    r = second.post(f"/api/hardware/nodes/{NODE}/cache/verify", {"prefix": PREFIX})
    assert r.status_code == 202, r.text
    verified = _wait(lambda: (j := _job(second, r.json()["id"]))["finished_at"] and j, "the verify finished")
    assert verified["status"] == "COMPLETED" and verified["result"] == {"ok": True, "problems": []}, verified
