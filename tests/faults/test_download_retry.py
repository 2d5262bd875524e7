"""A Hugging Face download whose store vanishes mid-upload fails; once the store is back a new
job for the same repo completes and the model is listed once. Real console, fake Hub on loopback."""
from __future__ import annotations

import os
import time

import httpx
import pytest

from tests.faults.conftest import minio_env, open_console, serve_backends
from tests.hub.fake_hf import FakeHub

REPO = "acme/retry-model"
PREFIX = "huggingface/acme_retry-model"
FILES = {
    "config.json": b'{"model_type": "llama"}',
    "model-00001.safetensors": os.urandom(300_000),
    "model-00002.safetensors": os.urandom(200_000),
}


@pytest.fixture
def fake_hub():
    hub = FakeHub({REPO: FILES}).start()
    yield hub
    hub.stop()


def _wait_job(c, job_id: int, *, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    job: dict = {}
    while time.monotonic() < deadline:
        job = httpx.get(f"{c.url}/api/download/{job_id}", headers=c.auth, timeout=10).json()
        if job["status"] in ("COMPLETED", "FAILED", "CANCELLED"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"download {job_id} never finished: {job}")


def test_a_download_retried_after_the_store_came_back_completes_once(tmp_path, s3, faulty_store, fake_hub,
                                                                      consoles):
    data = tmp_path / "console"
    c = open_console(data, extra_env={**minio_env(faulty_store, s3), "HF_ENDPOINT": fake_hub.url})
    consoles.append(c)
    faulty_store.hold("model-00002.safetensors", method="PUT")
    r = c.post("/api/download", {"repo_id": REPO, "format": "huggingface"})
    assert r.status_code == 202, r.text
    first = r.json()["id"]
    assert faulty_store.holding.wait(60), "the upload never reached the second file"
    faulty_store.dead = True
    faulty_store.release()
    failed = _wait_job(c, first)
    assert failed["status"] == "FAILED" and failed["error"], failed
    assert faulty_store.endpoint in failed["error"], failed["error"]  # it names the store that failed
    listing = httpx.get(f"{c.url}/api/storage/models", headers=c.auth, timeout=10).json()["items"]
    assert not [m for m in listing if m["prefix"] == PREFIX and m["complete"]], listing

    faulty_store.dead = False
    back_at = time.monotonic()
    r = c.post("/api/download", {"repo_id": REPO, "format": "huggingface"})
    assert r.status_code == 202, r.text
    done = _wait_job(c, r.json()["id"])
    took_s = time.monotonic() - back_at
    assert done["status"] == "COMPLETED" and done["error"] is None, done
    assert done["bytes_done"] == done["bytes_total"] == sum(map(len, FILES.values()))
    listing = httpx.get(f"{c.url}/api/storage/models", headers=c.auth, timeout=10).json()["items"]
    mine = [m for m in listing if m["prefix"] == PREFIX]
    assert len(mine) == 1 and mine[0]["complete"] and mine[0]["file_count"] == len(FILES), listing
    from hub.store import MinioModelStore

    direct = MinioModelStore(endpoint=s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key,
                             bucket="xgen-faults")
    assert [m.prefix for m in direct.scan_models() if m.complete] == [PREFIX]
    assert {f.path: f.size for f in direct.read_manifest(PREFIX).files} == {p: len(d) for p, d in FILES.items()}
    assert not (data / "downloads" / f"job-{first}").exists()
    print(f"\nretried download COMPLETED {took_s:.2f} s after the store came back")
    assert c.stop() == 0
    assert serve_backends(data) == []
