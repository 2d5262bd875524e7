"""The one bridge from async code to the database: `await run_db(fn, *args, **kwargs)`.

Django closes a request's stale connections at the start and end of every request. Nothing
does that for database work off the request cycle (the inference proxy, the node agent and its
workers, websocket consumers, async views' helpers): a worker thread keeps its connection for
life, and after a database restart every query on it fails until the process restarts. So all
such work goes through here, which

- runs `fn` in a worker thread, with stale or broken connections closed before and after
  (as Django's request_started/request_finished do; with CONN_MAX_AGE=0 each call opens and
  closes its own connection, with persistent connections CONN_HEALTH_CHECKS probes it);
- when `fn` fails because its connection was lost (OperationalError or InterfaceError, and the
  connection no longer works or the driver says so), closes the broken connection and runs
  `fn` once more on a new one (`db_async(fn, retry=False)` for a write that must not run twice);
- raises DatabaseUnavailable (an OperationalError) when the database cannot be reached even
  then, so callers can answer 503 instead of 500.

A call made inside an atomic block of the calling thread (thread_sensitive=True under
async_to_sync) is neither closed around nor retried: the transaction is the caller's.

Imports nothing of the project's apps (it moves to a `live/` app later).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import Error, InterfaceError, OperationalError, connections

log = logging.getLogger("xgen.db")

P = ParamSpec("P")
T = TypeVar("T")

# SQLSTATEs that mean the connection is gone or cannot be made now (PostgreSQL):
# class 08 (connection exception) and the shutdown/start-up/too-many ones.
_LOST_SQLSTATES = ("57P01", "57P02", "57P03", "53300")


class DatabaseUnavailable(OperationalError):
    """The database could not be reached, on a fresh connection too (answer 503, not 500)."""


def _in_atomic() -> bool:
    return any(conn.in_atomic_block for conn in connections.all(initialized_only=True))


def _close_stale() -> None:
    """close_old_connections(), minus connections inside an atomic block (the caller's)."""
    for conn in connections.all(initialized_only=True):
        if not conn.in_atomic_block:
            with contextlib.suppress(Error):  # closing a broken connection may fail; it is dropped anyway
                conn.close_if_unusable_or_obsolete()


def connection_lost(exc: BaseException) -> bool:
    """Whether a database error says the connection is gone or cannot be made (by its type and
    the driver's verdict alone; a lock timeout or a locked SQLite file is not).

    DatabaseUnavailable and InterfaceError are; so is psycopg's OperationalError without a
    SQLSTATE (a socket or protocol failure: refused, reset, "the connection is closed") or with
    one of a lost connection.
    """
    if isinstance(exc, (DatabaseUnavailable, InterfaceError)):
        return True
    if not isinstance(exc, OperationalError):
        return False
    cause = exc.__cause__
    if cause is None or type(cause).__module__.split(".")[0] != "psycopg":
        return False
    sqlstate = getattr(cause, "sqlstate", None)
    return sqlstate is None or sqlstate.startswith("08") or sqlstate in _LOST_SQLSTATES


def _drop_broken(exc: BaseException) -> bool:
    """After `exc`: close this thread's connections that no longer work; True when the
    connection was lost (not a query's own error, like a lock timeout or a locked SQLite file)."""
    if not isinstance(exc, (OperationalError, InterfaceError)):
        return False
    lost = connection_lost(exc)
    for conn in connections.all(initialized_only=True):
        if conn.in_atomic_block or conn.connection is None:
            continue  # the caller's, or already dropped (a failed connect; Atomic closes what it can't roll back)
        if not conn.is_usable():
            lost = True
            with contextlib.suppress(Error):
                conn.close()
    return lost


def _call(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any], retry: bool) -> T:
    if _in_atomic():
        return fn(*args, **kwargs)
    _close_stale()
    try:
        try:
            return fn(*args, **kwargs)
        except (OperationalError, InterfaceError) as exc:
            if not _drop_broken(exc) or isinstance(exc, DatabaseUnavailable):
                raise  # a query's own error; or a nested bridge call that already retried
            if not retry:
                raise DatabaseUnavailable(f"the database connection was lost: {exc}") from exc
            log.warning("database connection lost in %s (%s: %s); retrying once on a new connection",
                        getattr(fn, "__qualname__", fn), exc.__class__.__name__, str(exc).strip())
        try:
            return fn(*args, **kwargs)
        except (OperationalError, InterfaceError) as exc:
            if _drop_broken(exc):
                raise DatabaseUnavailable(f"the database is unavailable: {exc}") from exc
            raise
    finally:
        _close_stale()


_in_pool = sync_to_async(_call, thread_sensitive=False)
_in_shared_thread = sync_to_async(_call, thread_sensitive=True)


async def run_db(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` in a worker thread, on a working connection, retried once if it is lost."""
    return await _in_pool(fn, args, kwargs, True)


def run_db_sync(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """run_db for sync code that already runs on a worker thread (a cache sync, an upload):
    the same closing and retry, in the calling thread."""
    return _call(fn, args, kwargs, True)


def db_async(fn: Callable[P, T], *, retry: bool = True, thread_sensitive: bool = False
             ) -> Callable[P, Awaitable[T]]:
    """`fn` as a coroutine function that goes through run_db's bridge.

    retry=False: a lost connection raises DatabaseUnavailable instead of running `fn` again
    (a write that must not happen twice). thread_sensitive=True: run in asgiref's one shared
    thread (outside a request), so such calls run one at a time, in the order they are made.
    """
    bridge = _in_shared_thread if thread_sensitive else _in_pool

    @functools.wraps(fn)
    async def call(*args: Any, **kwargs: Any) -> T:
        return await bridge(fn, args, kwargs, retry)

    return call


__all__ = ["DatabaseUnavailable", "connection_lost", "db_async", "run_db", "run_db_sync"]
