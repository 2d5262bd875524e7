"""Chargeback's arithmetic (GPU-seconds split by busy seconds, idle per instance), the busy clock
that shares an instance's time among concurrent requests, and READY intervals by hour; then the
whole query on rows with known READY times and busy seconds."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from serving.proxy.chargeback import chargeback, ready_by_hour, ready_intervals, split_hour
from serving.proxy.usage import BusyClock


def test_an_hour_splits_by_busy_seconds_and_the_rest_idles():
    charged, idle = split_hour(ready_s=3600, gpus=2, busy={"a": 600, "b": 1200})
    assert charged == {"a": 1200, "b": 2400} and idle == 2 * 1800
    assert sum(charged.values()) + idle == 2 * 3600


def test_a_cpu_instance_counts_as_one_device_and_overcounted_busy_time_is_capped():
    charged, idle = split_hour(ready_s=100, gpus=0, busy={"a": 150, "b": 50})
    assert charged == {"a": 75, "b": 25} and idle == 0  # 200 busy seconds in 100 READY ones: shared pro rata
    assert split_hour(ready_s=0, gpus=4, busy={"a": 10}) == ({"a": 40}, 0)  # no READY history: busy time counts
    assert split_hour(ready_s=50, gpus=1, busy={}) == ({}, 50)


def test_the_busy_clock_shares_time_among_open_requests():
    clock = BusyClock()
    a = clock.start(0.0)
    b = clock.start(5.0)
    assert clock.stop(10.0, a) == pytest.approx(5 + 5 / 2)  # alone for 5 s, then half of 5 s
    assert clock.stop(15.0, b) == pytest.approx(5 / 2 + 5)
    c = clock.start(20.0)  # idle time between requests is nobody's
    assert clock.stop(21.0, c) == pytest.approx(1.0)


def test_ready_intervals_follow_the_transitions_and_split_by_hour():
    events = [(100.0, "READY"), (200.0, "UNLOADING"), (300.0, "LOADING"), (400.0, "READY")]
    assert ready_intervals(events, start=0, end=3700, ready_at_start=False) == [(100, 200), (400, 3700)]
    assert ready_intervals([(50.0, "STOPPED")], start=0, end=100, ready_at_start=True) == [(0, 50)]
    assert dict(ready_by_hour([(3000, 4000)])) == {0: 600, 3600: 400}


@pytest.mark.django_db
def test_chargeback_on_two_instances_and_two_keys_with_known_busy_times():
    from django.utils import timezone

    from hardware.models import Node
    from serving.models import InstanceEvent, ModelInstance, UsageBucket

    hour = datetime(2026, 11, 30, 10, tzinfo=UTC)
    node = Node.objects.create(name="n", address="127.0.0.1", last_heartbeat=timezone.now())
    two_gpus = ModelInstance.objects.create(model_name="big", model_path="/m", backend="b", node=node, gpus=[0, 1],
                                            state="STOPPED")
    cpu = ModelInstance.objects.create(model_name="small", model_path="/m", backend="b", node=node, gpus=[],
                                       state="STOPPED")
    # big: READY for the whole hour; small: READY for its second half.
    InstanceEvent.objects.create(instance=two_gpus, at=hour - timedelta(minutes=5), to_state="READY")
    InstanceEvent.objects.create(instance=two_gpus, at=hour + timedelta(hours=1, minutes=5), to_state="UNLOADING")
    InstanceEvent.objects.create(instance=cpu, at=hour + timedelta(minutes=30), to_state="READY")
    InstanceEvent.objects.create(instance=cpu, at=hour + timedelta(hours=1), to_state="STOPPED")
    for inst, key_id, busy in ((two_gpus, 1, 900), (two_gpus, 2, 300), (cpu, 2, 600)):
        UsageBucket.objects.create(bucket_start=hour, key_id=key_id, key_name=f"key-{key_id}", username="u",
                                   model=inst.model_name, instance_id=inst.pk, node="n", requests=1,
                                   busy_seconds=busy)
    out = chargeback(start=hour, end=hour + timedelta(hours=1), group_by="key")
    by_key = {i["key_id"]: i for i in out["items"]}
    assert by_key[1]["gpu_seconds"] == 2 * 900 and by_key[1]["key_name"] == "key-1"
    assert by_key[2]["gpu_seconds"] == 2 * 300 + 1 * 600
    idle = {i["instance_id"]: i["gpu_seconds"] for i in out["idle"]}
    assert idle == {two_gpus.pk: 2 * (3600 - 1200), cpu.pk: 1800 - 600}
    assert out["total_gpu_seconds"] == 2 * 3600 + 1800
    assert sum(i["share"] for i in out["items"] + out["idle"]) == pytest.approx(1.0, abs=1e-5)
    by_user = chargeback(start=hour, end=hour + timedelta(hours=1), group_by="user")
    assert by_user["items"] == [{"user": "u", "gpu_seconds": 3000.0, "busy_seconds": 1800.0,
                                 "share": round(3000 / 9000, 6)}]


@pytest.mark.django_db
def test_the_usage_page_lists_the_twenty_most_idle_and_links_to_all(viewer):
    from django.test import Client
    from django.utils import timezone

    from hardware.models import Node
    from serving.models import InstanceEvent, ModelInstance

    node = Node.objects.create(name="n", address="127.0.0.1", last_heartbeat=timezone.now())
    since = timezone.now() - timedelta(hours=2)
    for i in range(25):  # READY for 2 h, each on i + 1 GPUs: the most idle is the widest
        inst = ModelInstance.objects.create(model_name=f"m{i}", model_path="/m", backend="b", node=node,
                                            gpus=list(range(i + 1)), state="READY")
        InstanceEvent.objects.create(instance=inst, at=since, to_state="READY")
    c = Client()
    c.force_login(viewer.user)
    page = c.get("/usage/", {"range": "24h"}).content.decode()
    idle_table = page[page.index('id="idle-table"'):page.index("</table>", page.index('id="idle-table"'))]
    assert idle_table.count("<tr>") == 1 + 20  # the header and the 20 most idle
    assert "<td>m24</td>" in idle_table and "<td>m4</td>" not in idle_table
    more = page[page.index('id="idle-more"'):]
    assert "The 20 most idle of 25 instances" in more
    url = more[more.index('href="') + 6:more.index('">the chargeback API')].replace("&amp;", "&")
    answer = c.get(url)
    assert answer.status_code == 200, answer.content
    assert len(answer.json()["idle"]) == 25
