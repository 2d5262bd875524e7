"""Typed wrappers around live.publish for the hub's pages: a job's row, live, on its kind's page."""
from __future__ import annotations

import logging

from django.template.loader import render_to_string

from hub.models import CacheJob, DownloadJob, Job, UploadJob
from live.db import run_db
from live.publish import publish, publish_sync

log = logging.getLogger("xgen.hub.events")
DOWNLOADS_GROUP = "downloads"
UPLOADS_GROUP = "uploads"
# kind -> (the group of its page, the id of the list new rows go on top of)
PAGES = {DownloadJob.KIND: (DOWNLOADS_GROUP, "jobs"), UploadJob.KIND: (UPLOADS_GROUP, "uploads")}
CACHE_JOBS_LIST = "cache-jobs"  # a node's cache card: its jobs, newest first


def node_cache_group(node_name: str) -> str:
    """The group of a node's cache card (its page and the node page): that node's cache jobs."""
    return f"node-cache.{node_name}"


def page_of(job: Job) -> tuple[str, str]:
    """(the group of the page that shows the job, the id of the list its new rows go on top of)."""
    if job.kind == CacheJob.KIND:
        return node_cache_group(job.node), CACHE_JOBS_LIST
    return PAGES[job.kind]


def render_job_row(job: Job, *, oob: bool = False, can_cancel: bool = True) -> str:
    return render_to_string("hub/partials/_job_row.html", {"job": job, "oob": oob, "can_cancel": can_cancel})


async def publish_job(job: Job) -> None:
    """Send the job's row (status, progress bar, a download's files) to every page of its kind, from any process."""
    try:
        html = await run_db(render_job_row, job, oob=True)  # the row may read related rows (created_by)
    except Exception:  # a page fragment must never fail the job itself
        log.warning("could not render %s", job, exc_info=True)
        return
    await publish(page_of(job)[0], html, key=job.row_id)


def publish_job_sync(job: Job) -> None:
    """`publish_job` from a thread (a request's cancel, a cache job's progress)."""
    try:
        publish_sync(page_of(job)[0], render_job_row(job, oob=True), key=job.row_id)
    except Exception:  # the job goes on; a page that misses it shows it on reload
        log.warning("could not send the row of %s", job, exc_info=True)


def publish_new_job(job: Job) -> None:
    """From a request thread: put a just-created job at the top of every page of its kind."""
    group, list_id = page_of(job)
    try:
        publish_sync(group, f'<div hx-swap-oob="afterbegin:#{list_id}">{render_job_row(job)}</div>')
    except Exception:  # the job exists; a page that misses it shows it on reload
        log.warning("could not announce %s", job, exc_info=True)
