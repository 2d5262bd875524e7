"""A node's cache as a whole: disk used and free, each cached model and who uses it, Evict,
Verify, and the XGEN_CACHE_MAX_GB budget (least recently used unused models go first).

Which instance uses a cached model is serving's knowledge: serving hands in a users source at
start-up (`set_users_source`), as it does for GPU holders, so the hub never imports serving.
Evict and Verify touch files, so they run on the node's agent: the web process writes a
CacheJob row that the node's HubWorker claims (`claim_next_cache_job`, a conditional UPDATE).
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from hub import cache, jobs
from hub.cache import CacheFull, _sha256_of, cache_dir_for, model_lock, read_local_manifest
from hub.layout import CACHE_MANIFEST_NAME
from hub.models import CACHE_JOB_ACTIVE, CacheDisk, CacheEntry, CacheJob, CacheJobStatus, CacheState
from hub.paths import FORMAT_ROOTS, safe_join, validate_prefix
from hub.store import ModelStore, StoreError, get_store

log = logging.getLogger("xgen.hub.node_cache")

# Under MODELS_DIR, beside the format folders: no prefix can name it (validate_prefix wants gguf/ or
# huggingface/), and a rename into it stays on the cache's own disk.
EVICTING_DIR = ".xgen-evicting"


@dataclass
class CacheUser:
    """An instance that uses a cached model (serving's ModelInstance, as the hub sees it)."""

    id: int
    model_name: str
    state: str


UsersSource = Callable[[str], dict[str, list[CacheUser]]]
_users_source: UsersSource | None = None


def set_users_source(source: UsersSource) -> None:
    """Serving registers `node name -> {prefix: [CacheUser]}` for its active instances."""
    global _users_source
    _users_source = source


def users_of(node_name: str) -> dict[str, list[CacheUser]]:
    """Active instances of a node by the store prefix they load; {} before serving registers."""
    return _users_source(node_name) if _users_source is not None else {}


class CacheInUse(RuntimeError):
    """The cached model is used by an instance: it stays."""


# --------------------------------------------------------------------------- on the node's disk
def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(dirpath) / name).stat().st_size
            except OSError:
                pass
    return total


def local_models() -> dict[str, int]:
    """{prefix: bytes on disk} for every model folder under MODELS_DIR (format/name)."""
    root = Path(settings.MODELS_DIR)
    out: dict[str, int] = {}
    for fmt in FORMAT_ROOTS:
        base = root / fmt
        if not base.is_dir():
            continue
        for entry in sorted(base.iterdir()):
            if entry.is_dir() and not entry.is_symlink() and not entry.name.startswith(EVICTING_DIR):
                out[f"{fmt}/{entry.name}"] = _tree_bytes(entry)
    return out


def disk_figures() -> tuple[int, int, int]:
    """(bytes used by cached models, bytes free on the cache disk, disk size)."""
    root = Path(settings.MODELS_DIR)
    root.mkdir(parents=True, exist_ok=True)  # the agent's own cache folder, before its first sync
    usage = shutil.disk_usage(root)
    return sum(local_models().values()), usage.free, usage.total


def report_disk(*, node_name: str) -> CacheDisk | None:
    """Measure the cache and record it for the node's page and /metrics; copies on disk that
    no row describes get one (READY when a verified sync left its manifest), rows of READY
    copies whose folder is gone are dropped."""
    from hardware.models import Node

    node = Node.objects.filter(name=node_name).first()
    if node is None:
        return None
    on_disk = local_models()
    used, free, total = disk_figures()
    disk, _ = CacheDisk.objects.update_or_create(node=node, defaults={
        "used_bytes": used, "free_bytes": free, "total_bytes": total, "max_bytes": settings.CACHE_MAX_BYTES,
        "updated_at": timezone.now()})
    known = set(CacheEntry.objects.filter(node=node).values_list("prefix", flat=True))
    for prefix, size in on_disk.items():
        if prefix not in known:
            local = read_local_manifest(cache_dir_for(prefix))
            complete = bool(local and local.get("prefix") == prefix)
            CacheEntry.objects.create(node=node, prefix=prefix, state=CacheState.READY if complete else CacheState.FAILED,
                                      bytes_done=size, bytes_total=size,
                                      error="" if complete else "an incomplete copy (no manifest of a finished sync)")
    CacheEntry.objects.filter(node=node, state=CacheState.READY).exclude(prefix__in=list(on_disk)).delete()
    return disk


def evict(prefix: str, *, node_name: str) -> int:
    """Remove a cached model from this node's disk and its row; returns the bytes freed.
    CacheInUse while an instance of this node uses it.

    The folder is renamed out of MODELS_DIR/<prefix> into EVICTING_DIR first, then the row goes,
    then the files: a process killed at any point leaves the model whole or absent, never half
    a folder that a READY row still vouches for (the agent's start removes the rest)."""
    prefix = validate_prefix(prefix)
    users = users_of(node_name).get(prefix)
    if users:
        raise CacheInUse(f"{prefix} is used by {', '.join(f'#{u.id} {u.model_name}' for u in users)}: unload it first")
    local_dir = cache_dir_for(prefix)
    trash: Path | None = None
    with model_lock(prefix):  # never under a sync of the same model
        freed = _tree_bytes(local_dir) if local_dir.is_dir() else 0
        if local_dir.is_dir():
            trash = _move_to_trash(local_dir)
        CacheEntry.objects.filter(node__name=node_name, prefix=prefix).delete()
    if trash is not None:  # outside the lock: nothing else knows this name, a sync may start meanwhile
        shutil.rmtree(trash, ignore_errors=True)
    log.info("evicted %s from the cache of %s (%d bytes)", prefix, node_name, freed)
    return freed


def _move_to_trash(local_dir: Path) -> Path | None:
    """Rename a model folder into EVICTING_DIR (one atomic step); returns where it went. A model
    folder on another disk than MODELS_DIR is removed in place instead, its cache manifest first,
    so that a leftover of a killed removal is never taken for a verified copy (returns None)."""
    root = Path(settings.MODELS_DIR) / EVICTING_DIR
    root.mkdir(parents=True, exist_ok=True)
    trash = root / uuid.uuid4().hex
    try:
        os.rename(local_dir, trash)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        (local_dir / CACHE_MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(local_dir, ignore_errors=True)
        return None
    return trash


def sweep_evictions(*, node_name: str) -> int:
    """At the agent's start: remove what evictions cut short by a kill left in EVICTING_DIR, and
    end the cache jobs that were running then (no evict or verify runs before the agent does).
    Returns how many leftovers went."""
    root = Path(settings.MODELS_DIR) / EVICTING_DIR
    left = sorted(root.iterdir()) if root.is_dir() else []
    for path in left:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if left:
        log.warning("removed %d folder(s) of evictions cut short on %s", len(left), node_name)
    CacheJob.objects.filter(node=node_name, status=CacheJobStatus.RUNNING).update(
        status=CacheJobStatus.FAILED, finished_at=timezone.now(),
        error="the node's agent stopped during it (the cached copy is whole or gone, never half): run it again if needed")
    return len(left)


def verify(prefix: str, *, node_name: str, store: ModelStore | None = None,
           step: Callable[[int, int], None] | None = None) -> list[str]:
    """Re-check every cached file's size and sha256 against the store manifest; returns what
    differs (empty: the copy is exact) and records it on the cache row. `step(bytes checked,
    bytes in all)` is called before each file (a cache job's progress; it may raise to stop the
    check, which then records nothing)."""
    prefix = validate_prefix(prefix)
    local_dir = cache_dir_for(prefix)
    manifest = (store or get_store()).read_manifest(prefix)
    problems: list[str] = []
    if manifest is None:
        problems.append(f"{prefix} is no longer a complete model in the store")
    elif not local_dir.is_dir():
        problems.append("not on this node's disk")
    else:
        with model_lock(prefix):
            wanted = set()
            total, done = sum(f.size for f in manifest.files), 0
            for f in manifest.files:
                if step is not None:
                    step(done, total)
                done += f.size
                wanted.add(f.path)
                path = safe_join(local_dir, f.path)
                try:
                    size = path.stat().st_size
                except OSError:
                    problems.append(f"{f.path}: missing")
                    continue
                if size != f.size:
                    problems.append(f"{f.path}: {size} bytes, the manifest says {f.size}")
                elif f.sha256 and _sha256_of(path) != f.sha256:
                    problems.append(f"{f.path}: sha256 differs from the manifest")
            for dirpath, _dirs, files in os.walk(local_dir):
                for name in files:
                    rel = (Path(dirpath) / name).relative_to(local_dir).as_posix()
                    if rel not in wanted and rel != CACHE_MANIFEST_NAME:
                        problems.append(f"{rel}: not in the manifest")
    CacheEntry.objects.filter(node__name=node_name, prefix=prefix).update(
        verified_at=timezone.now(), verify_problems=problems,
        **({"state": CacheState.FAILED, "error": "Verify: " + "; ".join(problems)[:1900]} if problems else {}))
    return problems


def make_room(need: int, *, node_name: str, keep: str) -> list[str]:
    """Keep the cache under XGEN_CACHE_MAX_GB before `need` more bytes arrive for `keep`: evict
    unused cached models, least recently used first. Returns the prefixes evicted; CacheFull
    when even that is not enough (models in use are never evicted)."""
    limit = settings.CACHE_MAX_BYTES
    if not limit:
        return []
    on_disk = local_models()
    used = sum(on_disk.values())
    if used + need <= limit:
        return []
    in_use = set(users_of(node_name))
    rows = {e.prefix: e for e in CacheEntry.objects.filter(node__name=node_name, prefix__in=list(on_disk))}
    epoch = datetime.min.replace(tzinfo=UTC)

    def last_used(prefix: str):
        row = rows.get(prefix)
        return (row.last_used_at or row.updated_at) if row else epoch

    evicted = []
    for prefix in sorted((p for p in on_disk if p != keep and p not in in_use), key=last_used):
        if used + need <= limit:
            break
        try:
            used -= evict(prefix, node_name=node_name)
        except CacheInUse:
            continue
        evicted.append(prefix)
    if evicted:
        log.warning("XGEN_CACHE_MAX_GB: evicted %s (unused, least recently used first) to make room for %s",
                    ", ".join(evicted), keep)
    if used + need > limit:
        busy = sorted(p for p in on_disk if p in in_use and p != keep)
        raise CacheFull(f"{keep} needs {need / 2**20:.1f} MiB but the cache would pass XGEN_CACHE_MAX_GB "
                        f"({limit / 2**30:g} GiB, {used / 2**20:.1f} MiB used"
                        + (f", in use: {', '.join(busy)}" if busy else "") + ")")
    return evicted


# --------------------------------------------------------------------------- what a page shows
def overview(node) -> dict:
    """The node's cache for the API and the page: disk figures and every cached model."""
    disk = CacheDisk.objects.filter(node=node).first()
    users = users_of(node.name)
    entries = []
    for e in CacheEntry.objects.filter(node=node).order_by("prefix"):
        entries.append({
            "prefix": e.prefix, "state": e.state, "size_bytes": e.bytes_total or e.bytes_done,
            "last_used_at": e.last_used_at, "verified": e.verified, "verified_at": e.verified_at,
            "verify_problems": list(e.verify_problems or []), "error": e.error,
            "used_by": [{"id": u.id, "model_name": u.model_name, "state": u.state} for u in users.get(e.prefix, [])],
            "pending": list(CacheJob.objects.filter(node=node.name, target_prefix=e.prefix, status__in=CACHE_JOB_ACTIVE)
                            .values_list("action", flat=True)),
            "last_job_error": _last_job_error(node.name, e.prefix),
        })
    return {"node": node.name, "used_bytes": disk.used_bytes if disk else 0, "free_bytes": disk.free_bytes if disk else 0,
            "total_bytes": disk.total_bytes if disk else 0, "max_bytes": disk.max_bytes if disk else 0,
            "measured_at": disk.updated_at if disk else None, "models": entries}


def _last_job_error(node_name: str, prefix: str) -> str:
    """Why the last evict/verify of this copy failed on the agent ('' when it did not)."""
    last = CacheJob.objects.filter(node=node_name, target_prefix=prefix, finished_at__isnull=False).order_by(
        "-finished_at", "-pk").first()
    return f"{last.action} failed: {last.error}" if last and last.status == CacheJobStatus.FAILED else ""


# --------------------------------------------------------------------------- jobs for the agent
def request_cache_job(*, node, prefix: str, action: str, user=None) -> CacheJob:
    """Ask the node's agent to evict or verify a cached model. LookupError when the node has no
    such cached model; CacheInUse for an evict while an instance uses it (the agent checks again)."""
    prefix = validate_prefix(prefix)
    if not CacheEntry.objects.filter(node=node, prefix=prefix).exists():
        raise LookupError(f"{prefix} is not in the cache of {node.name}")
    if action == "evict":
        users = users_of(node.name).get(prefix)
        if users:
            raise CacheInUse(f"{prefix} is used by {', '.join(f'#{u.id} {u.model_name}' for u in users)}: unload it first")
    return CacheJob.objects.create(node=node.name, target_prefix=prefix, action=action, created_by=user)


def claim_next_cache_job(*, node_name: str) -> CacheJob | None:
    """Take this node's oldest pending cache job (`hub.jobs.claim_next`: one agent, once)."""
    return jobs.claim_next(CacheJob, node_name=node_name)


class CacheJobCancelled(Exception):
    """A user cancelled the job while it ran (`hub.jobs.request_cancel`)."""


def run_cache_job(job_id: int, *, store: ModelStore | None = None) -> CacheJob:
    """Do a claimed job on this node and record its outcome. A cancel asked after the claim stops
    it before it starts, and a Verify before its next file (its progress, in bytes checked, is on
    the job row for the live row: HubWorker publishes it)."""
    job = CacheJob.objects.get(pk=job_id)
    result: dict = {}

    def step(done: int, total: int) -> None:
        if CacheJob.objects.filter(pk=job.pk, cancel_requested=True).exists():
            raise CacheJobCancelled()
        jobs.update(CacheJob, job.pk, bytes_done=done, bytes_total=total)

    try:
        if job.cancel_requested:
            raise CacheJobCancelled()
        if job.action == "evict":
            result = {"freed_bytes": evict(job.prefix, node_name=job.node)}
        else:
            problems = verify(job.prefix, node_name=job.node, store=store, step=step)
            result = {"ok": not problems, "problems": problems}
        status, error = CacheJobStatus.COMPLETED, ""
    except CacheJobCancelled:
        status, error = CacheJobStatus.CANCELLED, "Cancelled by a user."
    except (CacheInUse, StoreError, OSError) as exc:
        status, error = CacheJobStatus.FAILED, str(exc)
    job = jobs.finish(CacheJob, job.pk, status=status, error=error, result=result)
    report_disk(node_name=job.node)
    return job


def evict_everywhere(prefix: str) -> tuple[list[str], list[str]]:
    """After a model left the store: ask every node holding a copy no instance uses to evict it.
    Returns (nodes asked, nodes where an instance still uses it)."""
    asked, kept = [], []
    for entry in CacheEntry.objects.filter(prefix=prefix).select_related("node"):
        if users_of(entry.node.name).get(prefix):
            kept.append(entry.node.name)
            continue
        if not CacheJob.objects.filter(node=entry.node.name, target_prefix=prefix, action="evict",
                                       status__in=CACHE_JOB_ACTIVE).exists():
            CacheJob.objects.create(node=entry.node.name, target_prefix=prefix, action="evict")
        asked.append(entry.node.name)
    return asked, kept


cache.set_room_keeper(make_room)  # sync_to_cache asks before it fetches (hub.apps imports this module)


__all__ = [
    "CacheInUse", "CacheJobCancelled", "CacheUser", "claim_next_cache_job", "disk_figures", "evict", "evict_everywhere",
    "local_models", "make_room", "overview", "report_disk", "request_cache_job", "run_cache_job",
    "set_users_source", "sweep_evictions", "users_of", "verify",
]
