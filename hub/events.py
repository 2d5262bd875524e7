"""Typed wrappers around live.publish for the hub's pages."""
from __future__ import annotations

import logging

from django.template.loader import render_to_string

from hub.models import DownloadJob, UploadJob
from live.db import run_db
from live.publish import publish, publish_sync

log = logging.getLogger("xgen.hub.events")
DOWNLOADS_GROUP = "downloads"
UPLOADS_GROUP = "uploads"


def job_row_id(job: DownloadJob) -> str:
    return f"job-{job.pk}"


def render_job_row(job: DownloadJob, *, oob: bool = False, can_cancel: bool = True) -> str:
    return render_to_string("hub/partials/_job_row.html", {"job": job, "oob": oob, "can_cancel": can_cancel})


async def publish_job(job: DownloadJob) -> None:
    """Send the job's table row (progress bar, status, per-file table) to every Downloads page."""
    try:
        html = await run_db(render_job_row, job, oob=True)  # the row may read related rows
    except Exception:  # a page fragment must never fail the download itself
        log.warning("could not render job %s", job.pk, exc_info=True)
        return
    await publish(DOWNLOADS_GROUP, html, key=job_row_id(job))


def publish_new_job(job: DownloadJob) -> None:
    """From a request thread: put a just-created job at the top of every Downloads page."""
    try:
        html = render_to_string("hub/partials/_job_row.html", {"job": job, "oob": False, "can_cancel": True})
        publish_sync(DOWNLOADS_GROUP, f'<div hx-swap-oob="afterbegin:#jobs">{html}</div>')
    except Exception:  # the job exists; a page that misses it shows it on reload
        log.warning("could not announce job %s", job.pk, exc_info=True)


def upload_row_id(job: UploadJob) -> str:
    return f"upload-{job.pk}"


def render_upload_row(job: UploadJob, *, oob: bool = False, can_cancel: bool = True) -> str:
    return render_to_string("hub/partials/_upload_row.html", {"upload": job, "oob": oob, "can_cancel": can_cancel})


async def publish_upload(job: UploadJob) -> None:
    """Send an upload job's row (status, progress bar) to every Upload page, from any process."""
    try:
        html = await run_db(render_upload_row, job, oob=True)  # the row reads created_by
    except Exception:  # a page fragment must never fail the upload itself
        log.warning("could not render upload %s", job.pk, exc_info=True)
        return
    await publish(UPLOADS_GROUP, html, key=upload_row_id(job))


def publish_new_upload(job: UploadJob) -> None:
    """From a request thread: put a just-created upload at the top of every Upload page."""
    try:
        html = render_upload_row(job)
        publish_sync(UPLOADS_GROUP, f'<div hx-swap-oob="afterbegin:#uploads">{html}</div>')
    except Exception:  # the job exists; a page that misses it shows it on reload
        log.warning("could not announce upload %s", job.pk, exc_info=True)
