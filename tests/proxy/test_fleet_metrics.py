"""/metrics also exports the dashboard's figures, read from the database at scrape time in a
worker thread: GPUs (memory, utilization, temperature, holder), instances by state, node
caches, download and upload bytes. Parsed with prometheus_client's own parser."""
from __future__ import annotations

import threading

import pytest
from django.db import InterfaceError
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from serving.proxy import app, fleet_metrics

pytestmark = pytest.mark.django_db(transaction=True)


async def _scrape(key: str) -> tuple[int, str]:
    scope = {"type": "http", "method": "GET", "path": "/metrics", "query_string": b"", "scheme": "http",
             "headers": [(b"authorization", f"Bearer {key}".encode())]}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app.proxy_app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]).decode()


def _samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def fleet(db):
    from hardware.models import GpuDevice, Node
    from hub.models import CacheDisk, DownloadJob, UploadJob
    from serving.models import ModelInstance

    node = Node.objects.create(name="gpu-a", address="10.0.0.5", last_heartbeat=timezone.now())
    Node.objects.create(name="gone", address="10.0.0.6")
    for index, used in ((0, 30_000), (1, 0)):
        GpuDevice.objects.create(node=node, index=index, vendor="NVIDIA", type="NVIDIA", name="H200",
                                 memory_total_mib=141_000, memory_used_mib=used, utilization_pct=55.0 if index == 0 else None,
                                 temperature_c=61.0)
    inst = ModelInstance.objects.create(model_name="qwen", model_path="gguf/q", node=node, state="READY", gpus=[0])
    ModelInstance.objects.create(model_name="old", model_path="gguf/o", node=node, state="STOPPED")
    CacheDisk.objects.create(node=node, used_bytes=5 * 2**30, free_bytes=200 * 2**30, total_bytes=500 * 2**30)
    DownloadJob.objects.create(repo_id="a/b", format="gguf", status="COMPLETED", bytes_done=1000)
    DownloadJob.objects.create(repo_id="a/c", format="gguf", status="DOWNLOADING", bytes_done=250)
    UploadJob.objects.create(local_path="/tmp/x", format="gguf", target_prefix="gguf/x", node="gpu-a",
                             status="UPLOADING", bytes_done=77)
    return inst


async def test_the_dashboards_figures_are_exported(fleet, admin):
    status, text = await _scrape(admin.key)
    assert status == 200
    s = _samples(text)
    gpu0 = (("gpu", "0"), ("name", "H200"), ("node", "gpu-a"))
    assert s[("xgen_gpu_memory_used_bytes", gpu0)] == 30_000 * 2**20
    assert s[("xgen_gpu_memory_total_bytes", gpu0)] == 141_000 * 2**20
    assert s[("xgen_gpu_utilization_percent", gpu0)] == 55.0
    assert ("xgen_gpu_utilization_percent", (("gpu", "1"), ("name", "H200"), ("node", "gpu-a"))) not in s  # unknown
    assert s[("xgen_gpu_temperature_celsius", gpu0)] == 61.0
    holders = {k: v for k, v in s.items() if k[0] == "xgen_gpu_holder_info"}
    assert holders == {("xgen_gpu_holder_info", (("gpu", "0"), ("instance", str(fleet.pk)), ("model", "qwen"),
                                                 ("node", "gpu-a"))): 1.0}
    assert s[("xgen_node_up", (("node", "gpu-a"),))] == 1 and s[("xgen_node_up", (("node", "gone"),))] == 0
    assert s[("xgen_instances", (("state", "READY"),))] == 1 and s[("xgen_instances", (("state", "STOPPED"),))] == 1
    assert s[("xgen_instances", (("state", "ERROR"),))] == 0
    assert s[("xgen_node_cache_used_bytes", (("node", "gpu-a"),))] == 5 * 2**30
    assert s[("xgen_node_cache_free_bytes", (("node", "gpu-a"),))] == 200 * 2**30
    assert s[("xgen_download_bytes", (("status", "COMPLETED"),))] == 1000
    assert s[("xgen_download_bytes", (("status", "DOWNLOADING"),))] == 250
    assert s[("xgen_download_jobs", (("status", "FAILED"),))] == 0
    assert s[("xgen_upload_bytes", (("status", "UPLOADING"),))] == 77
    exported = {f.name for f in text_string_to_metric_families(text)}
    assert set(fleet_metrics.FAMILIES) <= exported
    assert "xgen_inference_rejected" in exported  # the proxy's own counters are still there


async def test_the_database_is_read_off_the_event_loop(fleet, admin, monkeypatch):
    threads = []
    real = fleet_metrics.FleetCollector.collect
    monkeypatch.setattr(fleet_metrics.FleetCollector, "collect",
                        lambda self: (threads.append(threading.current_thread()), (yield from real(self)))[1])
    status, _ = await _scrape(admin.key)
    assert status == 200 and threads and threading.current_thread() not in threads


async def test_a_database_outage_leaves_the_proxy_counters(fleet, admin, monkeypatch):
    status, _ = await _scrape(admin.key)  # the key is now in the proxy's cache
    assert status == 200

    def down():
        raise InterfaceError("connection to 10.1.2.3 lost")

    monkeypatch.setattr(app, "render_fleet", down)
    status, text = await _scrape(admin.key)
    names = {f.name for f in text_string_to_metric_families(text)}
    assert status == 200 and "xgen_inference_rejected" in names and "xgen_instances" not in names


async def test_the_exposition_passes_the_lint_promtool_applies(fleet, admin):
    """promtool's `check metrics` rules, without promtool (Debian's prometheus package is 96 MB):
    every family has HELP and TYPE once, before its samples; names are snake_case with no colon; a
    counter's samples end in _total; units are base units (seconds, bytes), not ms/kb/mib."""
    import re

    status, text = await _scrape(admin.key)
    assert status == 200
    helps, types, sampled = {}, {}, []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helps, f"HELP twice for {name}"
            helps[name] = line
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in types, f"TYPE twice for {name}"
            types[name] = kind
        elif line and not line.startswith("#"):
            sampled.append(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0))
    assert types and set(helps) == set(types)
    for name, kind in types.items():
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", name), f"{name}: not snake_case"
        assert not re.search(r"_(ms|milliseconds|kb|mb|mib|gib)(_|$)", name), f"{name}: not a base unit"
        if kind == "counter":
            assert name.endswith("_total"), f"counter {name} should end in _total"
    for sample in sampled:
        family = next((t for t in types if sample == t or sample.startswith(t + "_")), None)
        assert family is not None, f"{sample}: a sample with no TYPE before it"
