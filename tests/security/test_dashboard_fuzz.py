"""The dashboard's inputs (the range in the query string and in the websocket's path) never
break it: any text gives the page (an unknown range is the default) or a refused socket."""
from __future__ import annotations

import pytest
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.routing import websocket_urlpatterns


@pytest.mark.django_db
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=st.text(max_size=40))
def test_any_range_renders_the_dashboard(value, viewer):
    client = Client()
    client.force_login(viewer.user)
    response = client.get("/", {"range": value})
    assert response.status_code == 200 and b"<h1>Dashboard</h1>" in response.content


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["/ws/dashboard/1h/", "/ws/dashboard/7d/", "/ws/dashboard/%2e%2e/"])
async def test_an_anonymous_socket_is_refused(path):
    comm = WebsocketCommunicator(URLRouter(websocket_urlpatterns), path)
    comm.scope["user"] = AnonymousUser()
    connected, code = await comm.connect()
    assert not connected and code == 4401


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", ["5y", "dashboard", "a" * 200, "..."])
async def test_an_unknown_range_socket_watches_the_default(name, viewer):
    comm = WebsocketCommunicator(URLRouter(websocket_urlpatterns), f"/ws/dashboard/{name}/")
    comm.scope["user"] = viewer.user
    connected, _ = await comm.connect()
    assert connected
    await comm.disconnect()
