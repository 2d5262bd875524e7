"""The fleet's samples: written per 10 s slot, rolled up into 5 min and 1 h rows, pruned past each
retention, and read back per chart slot (coarse rows first, the newest fine rows after them)."""
from __future__ import annotations

import pytest

from history.models import ALL_GPUS, HOST_GPU, ModelSample, ResourceSample
from history.samples import (
    LATENCY_BOUNDS_MS,
    RANGES,
    RETENTION_S,
    ModelCounter,
    ResourceReading,
    downsample,
    model_series,
    percentile,
    record_resources,
    resource_series,
    write_model_slots,
)

pytestmark = pytest.mark.django_db
T0 = 1_800_000_000 // 3600 * 3600  # an hour boundary


def _sample(at: float, used: int, util: float | None, node: str = "n1") -> None:
    record_resources(node=node, at=at, readings=[
        ResourceReading(gpu=HOST_GPU, mem_used_mib=1000, mem_total_mib=4000, util_pct=20.0),
        ResourceReading(gpu=0, mem_used_mib=used, mem_total_mib=80000, mem_alloc_mib=5000, util_pct=util)])


def test_a_slot_holds_one_sample_per_gpu():
    _sample(T0 + 3, 100, 10.0)
    _sample(T0 + 7, 200, 30.0)  # same 10 s slot: replaces
    rows = ResourceSample.objects.filter(step=10).order_by("gpu")
    # the node's GPUs together (-2), its host row (-1), and GPU 0
    assert [(r.at, r.gpu, r.mem_used_mib) for r in rows] == [(T0, -2, 200), (T0, -1, 1000), (T0, 0, 200)]


def test_rollup_averages_finished_windows_and_is_idempotent():
    for i in range(60):  # 10 minutes of samples: two 5 min windows
        _sample(T0 + i * 10, 100 + i, 50.0 if i < 30 else None)
    first = downsample(now=T0 + 600 + 1)
    again = downsample(now=T0 + 600 + 1)
    five = ResourceSample.objects.filter(step=300, gpu=0).order_by("at")
    assert [(r.at, r.mem_used_mib, r.util_pct, r.mem_alloc_mib) for r in five] == [
        (T0, 114, 50.0, 5000), (T0 + 300, 144, None, 5000)]
    # (ten 1 min + two 5 min windows) x (all GPUs, host, gpu0)
    assert first["rolled"] == 36 and again["rolled"] == 0


def test_each_resolution_is_pruned_past_its_retention():
    _sample(T0, 100, 1.0)
    downsample(now=T0 + 3600 * 2)
    assert set(ResourceSample.objects.values_list("step", flat=True)) == {10, 60, 300, 900, 3600}
    downsample(now=T0 + RETENTION_S[10] + 3600)
    assert set(ResourceSample.objects.values_list("step", flat=True)) == {300, 900, 3600}
    downsample(now=T0 + RETENTION_S[900] + 3600)
    assert set(ResourceSample.objects.values_list("step", flat=True)) == {300, 3600}
    downsample(now=T0 + RETENTION_S[300] + 3600)
    assert set(ResourceSample.objects.values_list("step", flat=True)) == {3600}
    downsample(now=T0 + RETENTION_S[3600] + 3600)
    assert not ResourceSample.objects.exists()


def test_a_read_joins_coarse_rows_with_the_newest_fine_ones():
    for i in range(0, 3600 * 3, 10):
        _sample(T0 + i, 1000, 40.0)
    downsample(now=T0 + 3600 * 2 + 5)  # rolled up to T0+2h; the last hour stays in 10 s rows only
    times, series = resource_series(RANGES["24h"], node="n1", per_gpu=True, now=T0 + 3600 * 3 - 1)
    assert ("n1", ALL_GPUS) not in series
    assert set(resource_series(RANGES["24h"], now=T0 + 3600 * 3 - 1)[1]) == {("n1", ALL_GPUS), ("n1", HOST_GPU)}
    gpu = series[("n1", 0)]
    filled = [i for i, v in enumerate(gpu.mem_used_mib) if v is not None]
    assert len(filled) == 12 and all(v == 1000 for v in gpu.mem_used_mib if v is not None)  # 3 h of 15 min slots
    assert times[filled[-1]] == T0 + 3600 * 3 - 900 and gpu.mem_total_mib == 80000
    assert series[("n1", HOST_GPU)].util_pct[filled[0]] == 20.0


def test_model_slots_add_up_across_processes_and_resolutions():
    a, b = ModelCounter(), ModelCounter()
    for counter, ms in ((a, 40), (b, 400)):
        for _ in range(10):
            counter.add(model="m", duration_s=ms / 1000, ttft_s=ms / 2000, prompt_tokens=3, completion_tokens=7,
                        failed=ms > 100, at=T0 + 5)
    write_model_slots(a.take())
    write_model_slots(b.take())  # the second process adds to the same row
    row = ModelSample.objects.get(step=10)
    assert (row.requests, row.errors, row.completion_tokens) == (20, 10, 140)
    assert sum(row.latency_hist) == 20 and len(row.latency_hist) == len(LATENCY_BOUNDS_MS) + 1
    downsample(now=T0 + 3600 + 1)
    assert ModelSample.objects.get(step=3600).requests == 20
    times, series = model_series(RANGES["1h"], now=T0 + 60)
    slot = next(s for s in series["m"].slots if s is not None)
    assert slot.requests == 20
    assert 25 <= percentile(slot.latency_hist, 0.5) <= 50 and 250 <= percentile(slot.latency_hist, 0.99) <= 500


def test_percentile_of_nothing_is_none():
    assert percentile([0] * 5, 0.5) is None and percentile([], 0.99) is None
