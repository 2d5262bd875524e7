"""Running one upload job on its node's agent: the copy in a thread, live progress, cancel.

A web process only creates the job (`hub.jobs.upload.create_upload_job`, after checking the path);
the agent of the job's node claims it (`hub.worker.HubWorker`) and runs it here, off the event
loop. The thread does the work (`hub.jobs.upload.execute_upload`: the node's own path check, the
copy with the manifest last, the index, the job's final state); this side writes progress to
the job row, sends it to every Upload page, and turns a cancel request into the thread's stop.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from django.db import close_old_connections

from hub.events import publish_job
from hub.jobs import upload as upload_jobs
from hub.models import UploadJob
from hub.store import ModelStore, get_store
from live.db import db_async

log = logging.getLogger("xgen.hub.uploads")

POLL_S = 0.3
STOP_WAIT_S = 30.0


# Through the one DB bridge (the agent lives for days, across database restarts).
_get_job = db_async(lambda job_id: UploadJob.objects.select_related("created_by").get(pk=job_id))
_update = db_async(upload_jobs.update_upload)


def _execute(job_id: int, store: ModelStore, progress: Callable[[int, int], None], cancel: threading.Event
             ) -> UploadJob:
    close_old_connections()
    try:
        return upload_jobs.execute_upload(job_id, store=store, progress=progress, cancel=cancel)
    finally:
        close_old_connections()


async def run_upload_job(job_id: int, *, store: ModelStore | None = None) -> UploadJob:
    """Run a claimed upload (status UPLOADING) to its end; returns the final job.

    If the agent stops meanwhile (this task is cancelled), the copy is stopped within a read and
    the job ends FAILED with that reason before the cancellation goes on.
    """
    store = store or get_store()
    job = await _get_job(job_id)
    await publish_job(job)
    cancel = threading.Event()
    state = {"done": job.bytes_done, "total": job.bytes_total}

    def progress(done: int, total: int) -> None:
        state["done"], state["total"] = done, total

    loop = asyncio.get_running_loop()
    work = loop.run_in_executor(None, _execute, job.pk, store, progress, cancel)
    last = (job.bytes_done, job.bytes_total)
    try:
        while not work.done():
            await asyncio.wait([work], timeout=POLL_S)
            if work.done():
                break
            current = await _get_job(job.pk)
            if current.cancel_requested:
                cancel.set()
            now = (state["done"], state["total"])
            if now != last:
                last = now
                await publish_job(await _update(job.pk, bytes_done=now[0], bytes_total=now[1]))
    except BaseException:
        cancel.set()  # the thread ends the job (FAILED: the agent stopped) and re-indexes the prefix
        await asyncio.wait([work], timeout=STOP_WAIT_S)
        raise
    job = work.result()
    await publish_job(job)
    log.info("upload %s of %s as %s: %s %s", job.number, job.local_path, job.target_prefix, job.status, job.error)
    return job


__all__ = ["run_upload_job"]
