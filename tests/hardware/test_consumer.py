"""The GPUs page's websocket: refuses anonymous users, pushes node cards after an inventory."""
from __future__ import annotations

import pytest
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser

from hardware.events import publish_gpus
from hardware.inventory import InventoryWorker
from hardware.models import Node
from hardware.routing import websocket_urlpatterns
from serving.node.agent import NodeAgent

app = URLRouter(websocket_urlpatterns)


@pytest.mark.django_db(transaction=True)
async def test_anonymous_is_refused():
    comm = WebsocketCommunicator(app, "/ws/gpus/")
    comm.scope["user"] = AnonymousUser()
    connected, code = await comm.connect()
    assert not connected and code == 4401


@pytest.mark.django_db(transaction=True)
async def test_inventory_pushes_the_node_cards(viewer):
    comm = WebsocketCommunicator(app, "/ws/gpus/")
    comm.scope["user"] = viewer.user
    connected, _ = await comm.connect()
    assert connected
    await Node.objects.acreate(name="cpu-node", address="127.0.0.1")
    worker, agent = InventoryWorker(), NodeAgent(name="cpu-node", address="127.0.0.1", workers=[])
    await worker.start(agent)
    html = await comm.receive_from(timeout=10)
    assert html.startswith('<div id="gpu-nodes" hx-swap-oob="true"')
    assert "cpu-node" in html and "No GPU detected — CPU node." in html
    assert "NVML: NVML Shared Library Not Found" in html
    assert await comm.receive_nothing(timeout=0.5)

    # A refresh sends only this node's card and the summary, each out-of-band by its id.
    await worker.refresh(agent)
    html = await comm.receive_from(timeout=10)
    if "gpu-summary" not in html:  # the consumer may flush the two fragments separately
        html += await comm.receive_from(timeout=5)
    node = await Node.objects.aget(name="cpu-node")
    assert html.lstrip().startswith(f'<section class="card node-card" id="node-{node.pk}" hx-swap-oob="true"')
    assert '<div class="grid three summary" id="gpu-summary" hx-swap-oob="true"' in html
    assert 'id="gpu-nodes"' not in html
    assert await comm.receive_nothing(timeout=0.5)

    await publish_gpus()
    assert 'id="gpu-nodes" hx-swap-oob="true"' in await comm.receive_from(timeout=5)
    await comm.disconnect()
