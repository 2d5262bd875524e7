"""live.db.run_db, the one sync->async database bridge, against a real PostgreSQL.

The server cuts a connection with pg_terminate_backend (what a restart does to every
connection): the bridge's next call, or the cut call itself, gets a working connection. The
connection is an extra alias on the loopback server's admin database (only SELECTs), in one
worker thread (the loop's default executor made single-threaded), so the thread that held the
cut connection is the one that runs the next call.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from asgiref.sync import sync_to_async
from django.db import OperationalError, connections

from live.db import DatabaseUnavailable, db_async, run_db
from tests.cluster.harness import PG_ADMIN_DSN, _pg_admin
from tests.procs import free_port
from xgenconsole.env import database_from_url

pytestmark = pytest.mark.cluster  # needs PostgreSQL on loopback

ALIAS = "rundb_pg"


@pytest.fixture
async def pg(django_db_blocker, tmp_path):
    """Install the alias (with the given overrides) in a single worker thread; removed after."""
    try:
        _pg_admin("SELECT 1")
    except Exception as exc:
        pytest.fail(f"this test needs PostgreSQL at {PG_ADMIN_DSN} (.ci/run starts it): {exc}")
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rundb")
    loop.set_default_executor(pool)

    def install(url: str = PG_ADMIN_DSN, **overrides) -> None:
        entry = {**database_from_url(url, data_dir=tmp_path), **overrides}
        connections.settings[ALIAS] = connections.configure_settings({"default": {}, ALIAS: entry})[ALIAS]

    with django_db_blocker.unblock():
        yield install
        await loop.run_in_executor(None, lambda: connections[ALIAS].close())
    connections.settings.pop(ALIAS, None)
    pool.shutdown(wait=True)


def _backend_pid() -> int:
    with connections[ALIAS].cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def _terminate(pid: int) -> None:
    _pg_admin(f"SELECT pg_terminate_backend({pid}, 5000)")  # waits until the backend is gone


@pytest.mark.parametrize("conn_settings", [
    {"CONN_MAX_AGE": 0},  # ours: each call opens and closes its connection
    {"CONN_MAX_AGE": None, "CONN_HEALTH_CHECKS": True},  # persistent, probed once per call
    {"CONN_MAX_AGE": None, "CONN_HEALTH_CHECKS": False},  # persistent, unprobed: the retry saves it
], ids=["closed-per-call", "persistent-health-checked", "persistent-retried"])
async def test_a_connection_cut_between_calls_is_replaced(pg, conn_settings):
    pg(**conn_settings)
    await run_db(_backend_pid)
    # The old way (sync_to_async without closing) keeps the connection for the thread's life.
    held = await sync_to_async(_backend_pid, thread_sensitive=False)()
    _terminate(held)
    attempts = []

    def call() -> int:
        attempts.append(1)
        return _backend_pid()

    after = await run_db(call)
    assert after != held
    assert len(attempts) == (2 if conn_settings.get("CONN_HEALTH_CHECKS") is False else 1)


async def test_a_connection_cut_during_a_call_is_retried_once_on_a_new_one(pg):
    pg()
    pids: list[int] = []

    def cut_then_query() -> int:
        pids.append(_backend_pid())
        if len(pids) == 1:
            _terminate(pids[0])
        with connections[ALIAS].cursor() as cursor:
            cursor.execute("SELECT 42")
            return cursor.fetchone()[0]

    assert await run_db(cut_then_query) == 42
    assert len(pids) == 2 and pids[0] != pids[1]
    assert await run_db(_backend_pid) != pids[0]  # and the next call works too


async def test_a_write_that_must_not_run_twice_is_not_retried(pg):
    pg()
    calls: list[int] = []

    def cut() -> int:
        calls.append(_backend_pid())
        _terminate(calls[-1])
        return _backend_pid()

    with pytest.raises(DatabaseUnavailable):
        await db_async(cut, retry=False)()
    assert len(calls) == 1
    assert await run_db(_backend_pid) != calls[0]  # the broken connection was dropped


async def test_a_database_that_is_down_raises_database_unavailable(pg):
    pg(f"postgres://postgres@127.0.0.1:{free_port()}/nothing?connect_timeout=2")
    attempts = []

    def call() -> int:
        attempts.append(1)
        return _backend_pid()

    with pytest.raises(DatabaseUnavailable) as err:
        await run_db(call)
    assert isinstance(err.value, OperationalError)  # callers that catch OperationalError still do
    assert len(attempts) == 2


async def test_a_query_error_is_not_retried(pg):
    pg()
    attempts = []

    def too_slow() -> None:
        attempts.append(1)
        with connections[ALIAS].cursor() as cursor:
            cursor.execute("SET statement_timeout = 10")
            cursor.execute("SELECT pg_sleep(1)")

    with pytest.raises(OperationalError) as err:
        await run_db(too_slow)
    assert not isinstance(err.value, DatabaseUnavailable) and len(attempts) == 1
    assert await run_db(_backend_pid)  # the connection still works (and was not needlessly dropped)


def test_a_channel_layer_that_hangs_never_holds_up_a_sender(settings):
    """A Redis that accepts connections and never answers (busy, or half restarted): every sender
    (live fragments, nudges, routing and credential pushes) gives up after SEND_TIMEOUT_S instead of
    holding the state change that sent it. CI once saw an unload wait 30 s in UNLOADING on it."""
    import socket
    import threading

    from channels.layers import channel_layers

    from live import groups
    from live.publish import publish_sync
    from serving.control.services import nudge_node

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])  # never answers
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": [f"redis://127.0.0.1:{silent.getsockname()[1]}/0"]}}}
    channel_layers.backends = {}
    try:
        assert groups.send_sync("some-group", {"type": "x"}) is False
        nudge_node("node-x")  # returns (bounded) instead of waiting on the socket
        publish_sync("instances", "<div></div>", key="k")
        assert held  # they did reach the silent server
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        silent.close()
        channel_layers.backends = {}
