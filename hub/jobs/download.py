"""Download jobs: a Hugging Face repository, fetched by a node agent's child process and written
into the store. Created by a web request, claimed by any agent, run by `hub.downloads`."""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import time
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from hub import jobs
from hub.imports import HubInputError
from hub.locks import lock_prefix, unlock_prefix
from hub.models import DOWNLOAD_ACTIVE, DownloadJob, DownloadStatus
from hub.paths import FORMAT_ROOTS, InvalidPrefix, name_from_repo_id, prefix_for
from hub.store import ModelExists, ModelStore, get_store

log = logging.getLogger("xgen.hub")

REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
PATTERN_RE = re.compile(r"^[A-Za-z0-9._*?\[\]/ -]{1,200}$")
MAX_PATTERNS = 50


def validate_download(*, repo_id: str, revision: str | None, format: str,
                      allow_patterns: list[str] | None) -> tuple[str, str, str, list[str]]:
    """Clean the fields of a download request or raise HubInputError / InvalidPrefix."""
    repo_id = (repo_id or "").strip()
    if not REPO_ID_RE.match(repo_id) or ".." in repo_id:
        raise InvalidPrefix(f"Invalid repository id {repo_id!r}: use 'owner/name'.")
    revision = (revision or "").strip()
    if revision and (not REVISION_RE.match(revision) or ".." in revision or "//" in revision):
        raise InvalidPrefix(f"Invalid revision {revision!r}.")
    if format not in FORMAT_ROOTS:
        raise HubInputError(f"Unknown format {format!r}: use gguf, huggingface or lora.")
    patterns = [p.strip() for p in (allow_patterns or []) if p and p.strip()]
    if len(patterns) > MAX_PATTERNS:
        raise HubInputError(f"At most {MAX_PATTERNS} allow patterns.")
    for p in patterns:
        if not PATTERN_RE.match(p) or ".." in p or p.startswith("/"):
            raise InvalidPrefix(f"Invalid allow pattern {p!r}.")
    return repo_id, revision, format, patterns


class NameCollision(ModelExists):
    """A download whose model name (made from its repo id) is held by a model of another origin
    (an upload, or another repo id that makes the same name: `own/rep` and `own_rep`)."""


def check_download_target(target: str, *, repo_id: str, replace: bool, store: ModelStore) -> None:
    """The rule of uploads for a download's target: ModelExists (409 `model_exists`) for a complete
    model unless `replace`; and a download replaces only a model downloaded from the same repo id
    (NameCollision, 409 `name_collision`): names made from repo ids are not one-to-one."""
    manifest = store.read_manifest(target)
    if manifest is None:
        return
    origin = str((manifest.source or {}).get("repo_id") or "")
    if origin != repo_id:
        what = f"a download of {origin}" if origin else "an upload"
        raise NameCollision(f"{target} is already a complete model in the store, from {what}; {repo_id} would "
                            f"take the same name: delete {target} first to download {repo_id} into it.")
    if not replace:
        raise ModelExists(f"{target} is already a complete model in the store (downloaded from {repo_id}): "
                          "download it with replace: true to replace it.")


def create_download_job(*, repo_id: str, revision: str | None = None, format: str,
                        allow_patterns: list[str] | None = None, replace: bool = False, user=None,
                        store: ModelStore | None = None) -> DownloadJob:
    """Queue a Hugging Face download; a hub agent worker claims it. The job holds its target's
    write lock until it ends (PrefixBusy while another upload or download writes that model).
    ModelExists / NameCollision (409) as `check_download_target` says; StoreError (502)."""
    repo_id, revision, format, patterns = validate_download(repo_id=repo_id, revision=revision, format=format,
                                                           allow_patterns=allow_patterns)
    target = prefix_for(format, name_from_repo_id(repo_id))
    check_download_target(target, repo_id=repo_id, replace=replace, store=store or get_store())
    with transaction.atomic():
        job = DownloadJob.objects.create(repo_id=repo_id, revision=revision, format=format, allow_patterns=patterns,
                                         target_prefix=target, replace=replace, created_by=user)
        lock_prefix(target, holder=jobs.holder(job))  # PrefixBusy: another upload or download of it
    return job


def download_holder(job_id: int) -> str:
    """The write-lock holder of download `job_id` (its number)."""
    return f"download:{job_id}"


def claim_next_job(*, node_name: str) -> DownloadJob | None:
    """Take the oldest PENDING download (any agent may: it reads only the Hub and the store)."""
    return jobs.claim_next(DownloadJob, node_name=node_name, any_node=True)


def request_cancel(*, job: DownloadJob) -> DownloadJob:
    """Ask a download to stop (`hub.jobs.request_cancel`): the agent kills its child process."""
    return jobs.request_cancel(job)


def update_job(job_id: int, **fields) -> DownloadJob:
    """Write progress or a state change; a finished job is never reopened."""
    return jobs.update(DownloadJob, job_id, **fields)


def finish_job(job_id: int, *, status: str, error: str = "") -> DownloadJob:
    """Move an active job to COMPLETED, FAILED or CANCELLED (only from an active state)."""
    return jobs.finish(DownloadJob, job_id, status=status, error=error)


def download_dirs(job_id: int) -> tuple[Path, Path]:
    """The folders one download writes on its node: the files, and the child's HF_HOME."""
    work = Path(settings.DATA_DIR) / "downloads"
    return work / f"job-{job_id}", work / f"job-{job_id}-hfhome"


def _is_download_child(pid: int, job_id: int) -> bool:
    """Whether `pid` is (still) the download child of this job, not a process that took its pid since."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rpartition(b")")[2].split()[0]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, IndexError):
        return False
    dest = str(download_dirs(job_id)[0]).encode()
    return state != b"Z" and b"hub.hf_download" in argv and dest in argv


def stop_download_child(job_id: int, pgid: int | None, *, wait_s: float = 10.0) -> bool:
    """Kill the process group of a download child left by an agent that died (SIGKILL: a download
    cannot be resumed), and wait until it is gone; False when none of it was running."""
    if not pgid or not _is_download_child(pgid, job_id):
        return False
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and _is_download_child(pgid, job_id):
        time.sleep(0.05)
    return True


def fail_orphaned_jobs(*, node_name: str) -> int:
    """Jobs this node had claimed before it restarted can't be resumed: their child processes are
    stopped (they run in their own session and outlive a `kill -9` of the agent), their folders
    removed, the jobs marked FAILED and their locks freed."""
    orphans = DownloadJob.objects.filter(node=node_name, status__in=[DownloadStatus.DOWNLOADING,
                                                                     DownloadStatus.UPLOADING])
    held = list(orphans.values_list("pk", "number", "target_prefix", "pgid"))
    for job_id, _number, _prefix, pgid in held:
        stopped = stop_download_child(job_id, pgid)
        for folder in download_dirs(job_id):
            shutil.rmtree(folder, ignore_errors=True)
        if stopped:
            log.warning("download %s: stopped its child process (group %s), left by the last agent", job_id, pgid)
    count = orphans.update(status=DownloadStatus.FAILED, pid=None, pgid=None, finished_at=timezone.now(),
                           error="The node agent restarted while this download ran: its download process was "
                                 "stopped and its files removed; the model in the store is unchanged.")
    for _job_id, number, prefix, _pgid in held:
        unlock_prefix(prefix, holder=download_holder(number))
    _remove_stray_download_dirs()
    return count


def _remove_stray_download_dirs() -> None:
    """Folders under DATA_DIR/downloads of jobs that no longer run (left by an agent that died before
    it had the pid on the job): no job of this node runs while its agent starts."""
    work = Path(settings.DATA_DIR) / "downloads"
    if not work.is_dir():
        return
    active = {f"job-{pk}" for pk in DownloadJob.objects.filter(status__in=DOWNLOAD_ACTIVE).values_list("pk", flat=True)}
    for folder in work.iterdir():
        base = folder.name.removesuffix("-hfhome")
        if folder.name.startswith("job-") and base not in active and folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)

