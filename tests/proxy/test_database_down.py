"""While the database is down the proxy answers 503 database_unavailable in the OpenAI shape,
never 500, and serves again by itself once it is back (the ASGI app called in-process; the
database calls stand in through the one bridge, run_db, that the proxy uses)."""
from __future__ import annotations

import json

import pytest
from django.db import InterfaceError

from accounts import credentials as auth
from accounts.credentials import Principal
from live.db import db_async
from serving.proxy import app
from serving.proxy import replicas as routing_table
from serving.proxy import routing as proxy_routing  # the model list's module, where it reads the table

ADMIN = Principal(user_id=1, username="admin", role="admin", key_id=1)


async def _get(path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict, dict]:
    scope = {"type": "http", "method": "GET", "path": path, "headers": headers, "query_string": b"",
             "scheme": "http"}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app.proxy_app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], dict(sent[0]["headers"]), json.loads(body)


def _down(*args, **kwargs):
    raise InterfaceError("connection to 10.1.2.3 lost")  # what the driver says when the server is gone


def _assert_unavailable(status: int, headers: dict, body: dict) -> None:
    assert status == 503, body
    assert set(body["error"]) == {"message", "type", "code"}
    assert body["error"]["code"] == "database_unavailable" and body["error"]["type"] == "service_unavailable"
    assert "10.1.2.3" not in body["error"]["message"]  # the driver's text stays in the log
    assert headers[b"retry-after"] == b"1"


async def test_a_key_lookup_while_the_database_is_down_is_503_then_works(monkeypatch):
    looked_up = []

    def lookup(raw: str):
        looked_up.append(raw)
        if len(looked_up) <= 2:  # the bridge's call and its one retry
            _down()
        return ADMIN

    monkeypatch.setattr(auth, "alookup_key", db_async(lookup))
    monkeypatch.setattr(proxy_routing, "routing_table", routing_table.RoutingTable())
    monkeypatch.setattr(routing_table, "_read_rows", lambda paused_s=0.0: ([], set(), []))
    key = [(b"authorization", b"Bearer xg-not-cached-" + b"1" * 20)]
    _assert_unavailable(*await _get("/v1/models", key))
    status, _, body = await _get("/v1/models", key)  # the database is back: no restart needed
    assert (status, body) == (200, {"object": "list", "data": []})


async def test_a_session_lookup_while_the_database_is_down_is_503(monkeypatch):
    monkeypatch.setattr(auth, "_asession_principal", db_async(_down))
    _assert_unavailable(*await _get("/v1/models", [(b"cookie", b"sessionid=abcdefgh12345678")]))


async def test_no_routing_table_yet_while_the_database_is_down_is_503_not_an_empty_list(monkeypatch):
    async def admin(raw):
        return ADMIN

    table = routing_table.RoutingTable()
    monkeypatch.setattr(auth, "alookup_key", admin)
    monkeypatch.setattr(proxy_routing, "routing_table", table)
    monkeypatch.setattr(routing_table, "_read_rows", _down)
    key = [(b"authorization", b"Bearer xg-some-key")]
    _assert_unavailable(*await _get("/v1/models", key))
    _assert_unavailable(*await _get("/v1/models", key))  # within REFRESH_S: no second query, same answer
    monkeypatch.setattr(routing_table, "_read_rows", lambda paused_s=0.0: ([], {"m"}, []))
    table.invalidate()
    assert (await _get("/v1/models", key))[0] == 200
    # With a table, a database that goes down again keeps the table serving.
    monkeypatch.setattr(routing_table, "_read_rows", _down)
    table.invalidate()
    assert (await _get("/v1/models", key))[0] == 200
    assert (await table.snapshot()).known_names == {"m"}


@pytest.mark.parametrize("path", ["/v1/models", "/metrics"])
async def test_an_unknown_key_while_the_database_is_down_is_503_not_401(monkeypatch, path):
    monkeypatch.setattr(auth, "alookup_key", db_async(_down))
    _assert_unavailable(*await _get(path, [(b"authorization", b"Bearer xg-" + path.encode())]))
