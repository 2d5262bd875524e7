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
