"""Upload jobs: a local file or folder on a node, copied into the store by that node's agent.
Created by a web request (checked first), claimed by the node's agent, run by `hub.uploads`."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.conf import settings
from django.db import transaction

from hub import jobs
from hub.imports import HubInputError, check_path_text
from hub.locks import lock_prefix
from hub.models import UploadJob, UploadStatus
from hub.paths import FORMAT_ROOTS, InvalidPrefix, prefix_for
from hub.store import ModelExists, ModelStore, NotARegularFile, StoreError, UploadCancelled, get_store
from hub.writes import after_failed_write, upload_local_model, validate_upload

log = logging.getLogger("xgen.hub")


def upload_holder(job_id: int) -> str:
    """The write-lock holder of upload `job_id` (its number)."""
    return f"upload:{job_id}"


def create_upload_job(*, local_path: str, format: str, name: str, node: str | None = None, replace: bool = False,
                      user=None, store: ModelStore | None = None) -> UploadJob:
    """Check an upload and queue it for the agent of the node the path is on; the job holds the
    model's write lock from here to its end.

    The node is `node`, or this process's own (settings.NODE_NAME: in `manage.py serve` the web
    server and the one agent are the same node). For a path on this process's node every rule of
    `check_import_path` runs now, so a refusal is a HubInputError before any job exists. For
    another node (a cluster whose web processes run elsewhere) only the path's text can be checked
    here; that node's agent runs the full check, on its own disk, before it reads a byte.
    Raises HubInputError / InvalidPrefix (400), ModelExists or PrefixBusy (409), StoreError (502).
    """
    from hardware.models import Node

    node_name = (node or "").strip() or settings.NODE_NAME
    if format not in FORMAT_ROOTS:
        raise HubInputError(f"Unknown format {format!r}: use gguf, huggingface or lora.")
    prefix = prefix_for(format, name)
    bytes_total = 0
    if node_name == settings.NODE_NAME:
        prefix, source = validate_upload(local_path=local_path, format=format, name=name)
        local_path, bytes_total = str(source.path), sum(f.size for f in source.files)
    else:
        if not Node.objects.filter(name=node_name).exists():
            raise HubInputError(f"No node named {node_name!r}: name a node listed under GPUs, or leave it empty "
                                f"for this server's ({settings.NODE_NAME}).")
        local_path = str(check_path_text(local_path))
    if not replace and (store or get_store()).exists(prefix):
        raise ModelExists(f"{prefix} is already a complete model in the store: upload it under another name, "
                          "or ask to replace it.")
    with transaction.atomic():
        job = UploadJob.objects.create(local_path=local_path, format=format, target_prefix=prefix, replace=replace,
                                       node=node_name, bytes_total=bytes_total, created_by=user)
        lock_prefix(prefix, holder=jobs.holder(job))
    return job


def claim_next_upload(*, node_name: str) -> UploadJob | None:
    """Take this node's oldest PENDING upload (the path is on its disk)."""
    return jobs.claim_next(UploadJob, node_name=node_name)


def update_upload(job_id: int, **fields) -> UploadJob:
    """Write progress of an active upload (a finished one is never changed)."""
    return jobs.update(UploadJob, job_id, **fields)


def finish_upload(job_id: int, *, status: str, error: str = "", **fields) -> UploadJob:
    """Move an active upload to COMPLETED, FAILED or CANCELLED and release the model's lock."""
    return jobs.finish(UploadJob, job_id, status=status, error=error, **fields)


def execute_upload(job_id: int, *, store: ModelStore | None = None,
                   progress: Callable[[int, int], None] | None = None,
                   cancel: threading.Event | None = None) -> UploadJob:
    """Run a claimed upload (status UPLOADING) to its end, in this thread; returns the final job.

    The node's own rules apply again here (`check_import_path` on this disk: the request may have
    been checked on another host, and files change). Setting `cancel` stops it within a read: it
    ends CANCELLED when a user asked (the job's cancel_requested), else FAILED (the agent stopped).
    Every failure leaves nothing listed as complete (`write_model`).
    """
    job = UploadJob.objects.get(pk=job_id)
    if job.status != UploadStatus.UPLOADING:
        return job
    store = store or get_store()
    kept = f" ({job.target_prefix}, which it was to replace, is unchanged)" if job.replace else ""
    try:
        artifact = upload_local_model(local_path=job.local_path, format=job.format,
                                      name=job.target_prefix.split("/", 1)[1], store=store, progress=progress,
                                      cancel=cancel, replace=job.replace)
    except UploadCancelled:
        if UploadJob.objects.filter(pk=job_id, cancel_requested=True).exists():
            return finish_upload(job_id, status=UploadStatus.CANCELLED,
                                 error=f"Cancelled by a user; nothing of it is listed as complete{kept}.")
        return finish_upload(job_id, status=UploadStatus.FAILED,
                             error=f"The node agent stopped during this upload; nothing of it is listed as "
                                   f"complete{kept}.")
    except (HubInputError, InvalidPrefix, ModelExists, NotARegularFile) as exc:  # the source's fault, or refused
        return finish_upload(job_id, status=UploadStatus.FAILED, error=str(exc))
    except StoreError as exc:
        log.warning("upload %s of %s as %s failed: %s", job_id, job.local_path, job.target_prefix, exc)
        return finish_upload(job_id, status=UploadStatus.FAILED, error=f"The model store failed: {exc}")
    except Exception as exc:
        log.exception("upload %s of %s as %s failed", job_id, job.local_path, job.target_prefix)
        return finish_upload(job_id, status=UploadStatus.FAILED, error=str(exc) or exc.__class__.__name__)
    return finish_upload(job_id, status=UploadStatus.COMPLETED, bytes_done=artifact.size_bytes,
                         bytes_total=artifact.size_bytes)


def request_upload_cancel(*, job: UploadJob) -> UploadJob:
    """Ask an upload to stop (`hub.jobs.request_cancel`); nothing of it stays listed as complete."""
    return jobs.request_cancel(job)


def fail_orphaned_uploads(*, node_name: str, store: ModelStore | None = None) -> int:
    """Uploads this node's agent was running when it stopped can't be resumed: FAILED with the
    reason, their locks freed, and their prefixes re-indexed (nothing half-written listed complete)."""
    orphans = list(UploadJob.objects.filter(node=node_name, status=UploadStatus.UPLOADING))
    for job in orphans:
        finish_upload(job.pk, status=UploadStatus.FAILED,
                      error="The node agent restarted while this upload ran; nothing of it is listed as complete. "
                            "Upload it again.")
        try:
            after_failed_write(job.target_prefix, store=store or get_store())
        except Exception:
            log.warning("could not re-index %s after its orphaned upload", job.target_prefix, exc_info=True)
    return len(orphans)

