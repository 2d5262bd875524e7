"""The hub's part of the node agent: the demo model, the store index refresh, download and upload jobs."""
from __future__ import annotations

import asyncio
import logging

from hub import index, node_cache, writes
from hub.downloads import run_download_job
from hub.events import publish_job
from hub.jobs import download as download_jobs
from hub.jobs import upload as upload_jobs
from hub.models import CacheJob
from hub.uploads import run_upload_job
from live.db import db_async, run_db

log = logging.getLogger("xgen.hub.worker")

INDEX_REFRESH_S = 60
JOB_POLL_S = 1.0
MAX_PARALLEL_DOWNLOADS = 2
MAX_PARALLEL_UPLOADS = 2

# Not retried on a lost connection: had the first claim committed, a second would take a second job.
_claim_next_job = db_async(download_jobs.claim_next_job, retry=False)
_claim_next_upload = db_async(upload_jobs.claim_next_upload, retry=False)
_claim_next_cache_job = db_async(node_cache.claim_next_cache_job, retry=False)
_get_cache_job = db_async(lambda job_id: CacheJob.objects.select_related("created_by").get(pk=job_id))
CACHE_REPORT_S = 10  # the node page's and /metrics' cache figures (a walk of the cache folder)


class HubWorker:
    """Claims download jobs and this node's upload jobs (conditional UPDATEs, so two agents never
    take one), runs them off the event loop, and keeps the ModelArtifact index in step with the store."""

    name = "hub"

    def __init__(self) -> None:
        self._jobs: set[asyncio.Task] = set()
        self._uploads: set[asyncio.Task] = set()

    async def start(self, agent) -> None:
        from hub.demo import ensure_demo_model

        await run_db(download_jobs.fail_orphaned_jobs, node_name=agent.name)
        try:
            failed = await run_db(upload_jobs.fail_orphaned_uploads, node_name=agent.name)
            if failed:
                log.warning("%d upload(s) of %s were cut short by the agent's restart: marked FAILED", failed,
                            agent.name)
        except Exception:
            log.exception("could not end the uploads cut short by the last stop")
        try:
            await run_db(node_cache.sweep_evictions, node_name=agent.name)
        except Exception:
            log.warning("could not remove what evictions cut short left", exc_info=True)
        try:
            await run_db(writes.sweep_store)
        except Exception:
            log.warning("could not sweep the store of what interrupted writes left", exc_info=True)
        try:
            await run_db(ensure_demo_model)
        except Exception:
            log.exception("could not put the demo model in the store")

    @staticmethod
    async def _run_cache_job(job: CacheJob) -> None:
        """Run a claimed Evict or Verify in a worker thread (files and hashes, no loop time) with
        its row live on the node's cache card: RUNNING, a Verify's progress each JOB_POLL_S, its end."""
        await publish_job(job)
        work = asyncio.ensure_future(run_db(node_cache.run_cache_job, job.pk))
        shown = job.bytes_done
        while not work.done():
            await asyncio.wait([work], timeout=JOB_POLL_S)
            if not work.done() and (current := await _get_cache_job(job.pk)).bytes_done != shown:
                shown = current.bytes_done
                await publish_job(current)
        await publish_job(work.result())

    async def run(self, agent) -> None:
        loop = asyncio.get_running_loop()
        next_refresh = loop.time()  # the first pass indexes the store at once
        next_report = loop.time()
        while True:
            # Evict and Verify run one at a time, each in a worker thread (files and hashes, no loop time).
            while (cache_job := await _claim_next_cache_job(node_name=agent.name)) is not None:
                log.info("cache %s %s on %s", cache_job.action, cache_job.prefix, agent.name)
                try:
                    await self._run_cache_job(cache_job)
                except Exception:
                    log.exception("cache job %s failed", cache_job.pk)
                next_report = loop.time() + CACHE_REPORT_S  # run_cache_job measured the disk
            if loop.time() >= next_report:
                next_report = loop.time() + CACHE_REPORT_S
                try:
                    await run_db(node_cache.report_disk, node_name=agent.name)
                except Exception:
                    log.warning("could not measure the cache of %s", agent.name, exc_info=True)
            while len(self._jobs) < MAX_PARALLEL_DOWNLOADS:
                job = await _claim_next_job(node_name=agent.name)
                if job is None:
                    break
                log.info("download %s: %s claimed by %s", job.number, job.repo_id, agent.name)
                task = asyncio.create_task(run_download_job(job.pk, node_name=agent.name), name=f"download-{job.pk}")
                self._jobs.add(task)
                task.add_done_callback(self._jobs.discard)
            while len(self._uploads) < MAX_PARALLEL_UPLOADS:
                upload = await _claim_next_upload(node_name=agent.name)
                if upload is None:
                    break
                log.info("upload %s: %s -> %s claimed by %s", upload.number, upload.local_path, upload.target_prefix,
                         agent.name)
                task = asyncio.create_task(run_upload_job(upload.pk), name=f"upload-{upload.pk}")
                self._uploads.add(task)
                task.add_done_callback(self._uploads.discard)
            if loop.time() >= next_refresh:
                next_refresh = loop.time() + INDEX_REFRESH_S
                try:
                    await run_db(writes.finish_interrupted_switches)
                    await run_db(index.refresh_index)
                except Exception:
                    log.warning("store index refresh failed", exc_info=True)
            await asyncio.sleep(JOB_POLL_S)

    async def stop(self, agent) -> None:
        tasks = [*self._jobs, *self._uploads]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["HubWorker"]
