import pytest

from hardware.services import register_node


@pytest.mark.django_db(transaction=True)
async def test_readyz_needs_a_fresh_node(async_client):
    response = await async_client.get("/readyz")
    assert response.status_code == 503
    assert "no node agent has a fresh heartbeat" in response.json()["reasons"]
    from asgiref.sync import sync_to_async

    await sync_to_async(register_node)(name="n1", address="127.0.0.1")
    response = await async_client.get("/readyz")
    assert response.status_code == 200 and response.json()["nodes"] == ["n1"]


@pytest.mark.django_db
def test_healthz_needs_no_auth(client):
    assert client.get("/healthz").json() == {"status": "ok"}


@pytest.mark.django_db
def test_health_answers_as_llama_server_does(client):
    """guidellm (default settings) checks GET /health before a run, as engines answer it (issue 34 #22)."""
    for headers in ({}, {"HTTP_AUTHORIZATION": "Bearer xgen_whatever"}):
        response = client.get("/health", **headers)
        assert response.status_code == 200 and response.json() == {"status": "ok"}
        assert response["Content-Type"] == "application/json"


@pytest.mark.django_db(transaction=True)
async def test_readyz_says_database_unavailable_without_the_drivers_text(async_client, monkeypatch, caplog):
    """Anyone may call /readyz: the driver's message (paths, hosts, users) goes to the log only."""
    import sqlite3

    from django.db.backends.sqlite3.base import DatabaseWrapper

    def refuse(self, conn_params):
        raise sqlite3.OperationalError("unable to open database file /srv/secret-dir/xgen.sqlite3")

    monkeypatch.setattr(DatabaseWrapper, "get_new_connection", refuse)
    response = await async_client.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {"status": "not ready", "reasons": ["database unavailable"]}
    assert "secret-dir" in caplog.text
