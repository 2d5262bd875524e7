"""No request waits for the database once a process has its routing table (issue 18): the table is
re-read in the background, at once when a state change is pushed over the channel layer."""
from __future__ import annotations

import asyncio
import sqlite3

import pytest
from asgiref.sync import sync_to_async
from django.db import connection
from django.utils import timezone

from serving.proxy import replicas

pytestmark = pytest.mark.django_db(transaction=True)


def _ready_instance(name: str):
    from hardware.models import Node
    from serving.models import ModelInstance

    node, _ = Node.objects.get_or_create(name="push-node", defaults={"address": "127.0.0.1",
                                                                    "last_heartbeat": timezone.now()})
    return ModelInstance.objects.create(model_name=name, model_path="/m", backend="b", node=node, port=18555,
                                        state="READY", ready_at=timezone.now())


async def test_a_pushed_state_change_refreshes_the_table_without_a_request_waiting(monkeypatch):
    from serving.control import events

    monkeypatch.setattr(replicas, "REFRESH_S", 3600.0)  # no timer: only the push can refresh it
    table = replicas.RoutingTable(listen=True)
    try:
        assert (await table.snapshot()).by_name == {}
        await sync_to_async(_ready_instance)("pushed")
        assert "pushed" not in (await table.snapshot()).by_name  # nothing told it yet
        await sync_to_async(events.routing_changed)()
        for _ in range(200):
            if "pushed" in (await table.snapshot()).by_name:
                break
            await asyncio.sleep(0.05)
        assert "pushed" in (await table.snapshot()).by_name
    finally:
        await table.stop()


async def test_a_request_is_served_from_the_table_while_the_database_is_locked(monkeypatch):
    assert connection.vendor == "sqlite"  # the test suite's database: a file this test can lock
    await sync_to_async(_ready_instance)("locked")
    table = replicas.RoutingTable(listen=True)
    blocker = sqlite3.connect(connection.settings_dict["NAME"], timeout=1)
    try:
        assert "locked" in (await table.snapshot()).by_name
        blocker.execute("BEGIN EXCLUSIVE")  # any read of the database now waits for this lock
        await asyncio.sleep(replicas.REFRESH_S * 1.5)  # the table is older than a refresh period
        for _ in range(20):  # a request that waited for a read would hang here until the lock goes
            snap = await asyncio.wait_for(table.snapshot(), 5)
            assert "locked" in snap.by_name
    finally:
        blocker.rollback()
        blocker.close()
        await table.stop()
