"""One writer per model prefix: the PrefixLock row an upload job, a download job, `manage.py
hub_upload` or a delete holds while it writes a model (any process, any host, any database)."""
from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import IntegrityError, transaction

from hub.models import FINAL_STATES, Job, JobKind, PrefixLock

log = logging.getLogger("xgen.hub")


class PrefixBusy(RuntimeError):
    """Another writer (upload, download, CLI, delete) holds the model's lock: the API answers 409."""


def process_holder(kind: str) -> str:
    """A lock holder for work done by this process itself (`manage.py hub_upload`, a delete)."""
    return f"{kind}:{socket.gethostname()}:{os.getpid()}"


def _holder_alive(holder: str) -> bool:
    """Whether a lock's holder may still be writing (when in doubt: yes)."""
    kind, _, rest = holder.partition(":")
    if kind in (JobKind.UPLOAD, JobKind.DOWNLOAD) and rest.isdigit():
        return Job.objects.filter(kind=kind, number=int(rest)).exclude(status__in=FINAL_STATES).exists()
    host, _, pid = rest.rpartition(":")
    if kind in ("cli", "delete") and pid.isdigit() and host == socket.gethostname():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return True


def describe_holder(holder: str) -> str:
    kind, _, rest = holder.partition(":")
    if kind in ("upload", "download") and rest.isdigit():
        return f"{kind} job {rest}"
    host, _, pid = rest.rpartition(":")
    what = {"cli": "manage.py hub_upload", "delete": "a delete"}.get(kind, kind)
    return f"{what} (pid {pid} on {host})" if pid else what


def lock_prefix(prefix: str, *, holder: str) -> None:
    """Take the write lock of a model prefix for `holder`, or raise PrefixBusy.

    An INSERT on a unique column decides, so it holds across web processes, agents and hosts
    (any database). A lock left by a holder that has ended (a job in a final state, a dead
    `hub_upload` on this host) is taken over.
    """
    for _ in range(3):
        try:
            with transaction.atomic():
                PrefixLock.objects.create(prefix=prefix, holder=holder)
            return
        except IntegrityError:
            current = PrefixLock.objects.filter(prefix=prefix).values_list("holder", flat=True).first()
            if current is None:  # released meanwhile
                continue
            if current == holder:
                return
            if _holder_alive(current):
                raise PrefixBusy(f"{prefix} is being written by {describe_holder(current)}: wait until it has "
                                 "finished, or cancel it.") from None
            log.warning("taking over the write lock of %s from %s, which has ended", prefix, current)
            PrefixLock.objects.filter(prefix=prefix, holder=current).delete()
    raise PrefixBusy(f"{prefix} is being written by another writer: try again.")


def unlock_prefix(prefix: str, *, holder: str) -> None:
    PrefixLock.objects.filter(prefix=prefix, holder=holder).delete()


@contextmanager
def prefix_locked(prefix: str, *, holder: str) -> Iterator[None]:
    """Hold a prefix's write lock for the block (PrefixBusy when another writer has it)."""
    lock_prefix(prefix, holder=holder)
    try:
        yield
    finally:
        unlock_prefix(prefix, holder=holder)


def busy_prefixes() -> set[str]:
    """Model prefixes a live writer holds the lock of now (an upload, a download, the CLI, a delete)."""
    return {prefix for prefix, holder in PrefixLock.objects.values_list("prefix", "holder") if _holder_alive(holder)}


__all__ = ["PrefixBusy", "busy_prefixes", "describe_holder", "lock_prefix", "prefix_locked", "process_holder",
           "unlock_prefix"]
