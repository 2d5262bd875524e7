"""The node page's cache card: viewers read it, operators queue Evict and Verify from it."""
from __future__ import annotations

import pytest
from django.test import Client
from django.utils import timezone

from hub import node_cache
from hub.models import CacheEntry, CacheJob

pytestmark = pytest.mark.django_db

HTMX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture
def cached(hub_dirs, settings):
    from hardware.models import Node
    from serving.control.allocation import cache_users

    node = Node.objects.create(name="page-node", address="127.0.0.1", last_heartbeat=timezone.now())
    for name, size in (("free", 2048), ("busy", 4096)):  # copies on disk (the card measures them)
        (settings.MODELS_DIR / "gguf" / name).mkdir(parents=True)
        (settings.MODELS_DIR / "gguf" / name / "m.gguf").write_bytes(b"x" * size)
    CacheEntry.objects.create(node=node, prefix="gguf/free", state="READY", bytes_total=2048)
    CacheEntry.objects.create(node=node, prefix="gguf/busy", state="READY", bytes_total=4096)
    node_cache.set_users_source(lambda name: {"gguf/busy": [node_cache.CacheUser(9, "busy-chat", "READY")]})
    node_cache.report_disk(node_name="page-node")
    yield node
    node_cache.set_users_source(cache_users)


def _client(account) -> Client:
    c = Client()
    c.force_login(account.user)
    return c


def test_the_node_page_fetches_the_card_and_a_viewer_reads_it(cached, viewer):
    c = _client(viewer)
    assert 'hx-get="/nodes/page-node/cache/"' in c.get("/nodes/page-node/").content.decode()
    html = c.get("/nodes/page-node/cache/", **HTMX).content.decode()
    assert "free of" in html and "gguf/free" in html and "2.0\xa0KB" in html
    assert "busy-chat" in html and "Evict" not in html  # a viewer gets no buttons
    assert "<html" in c.get("/nodes/page-node/cache/").content.decode()  # without JS: a page of its own
    assert c.post("/nodes/page-node/cache/evict/", {"prefix": "gguf/free"}).status_code == 403


def test_an_operator_queues_evict_and_verify_and_is_told_why_not(cached, operator):
    c = _client(operator)
    html = c.get("/nodes/page-node/cache/", **HTMX).content.decode()
    assert 'title="In use: unload busy-chat first"' in html
    html = c.post("/nodes/page-node/cache/evict/", {"prefix": "gguf/busy"}, **HTMX).content.decode()
    assert "used by #9 busy-chat" in html and not CacheJob.objects.exists()
    html = c.post("/nodes/page-node/cache/verify/", {"prefix": "gguf/free"}, **HTMX).content.decode()
    assert "verify queued" in html and 'hx-trigger="every 2s"' in html
    r = c.post("/nodes/page-node/cache/evict/", {"prefix": "gguf/free"})
    assert r.status_code == 302 and r["Location"] == "/nodes/page-node/"
    assert sorted(CacheJob.objects.values_list("action", flat=True)) == ["evict", "verify"]


def test_the_card_says_why_the_agent_refused(cached, viewer):
    CacheJob.objects.create(node="page-node", target_prefix="gguf/busy", action="evict", status="FAILED",
                            error="gguf/busy is used by #9 busy-chat: unload it first", finished_at=timezone.now())
    html = _client(viewer).get("/nodes/page-node/cache/", **HTMX).content.decode()
    assert "evict failed: gguf/busy is used by #9 busy-chat" in html
