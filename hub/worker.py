"""The hub's part of the node agent: the demo model, the store index refresh, download jobs."""
from __future__ import annotations

import asyncio
import logging

from hub import services
from hub.downloads import run_download_job
from live.db import db_async, run_db

log = logging.getLogger("xgen.hub.worker")

INDEX_REFRESH_S = 60
JOB_POLL_S = 1.0
MAX_PARALLEL_DOWNLOADS = 2

# Not retried on a lost connection: had the first claim committed, a second would take a second job.
_claim_next_job = db_async(services.claim_next_job, retry=False)


class HubWorker:
    """Claims download jobs (conditional UPDATE, so two agents never take one) and keeps the
    ModelArtifact index in step with the store."""

    name = "hub"

    def __init__(self) -> None:
        self._jobs: set[asyncio.Task] = set()

    async def start(self, agent) -> None:
        from hub.demo import ensure_demo_model

        await run_db(services.fail_orphaned_jobs, node_name=agent.name)
        try:
            await run_db(ensure_demo_model)
        except Exception:
            log.exception("could not put the demo model in the store")

    async def run(self, agent) -> None:
        loop = asyncio.get_running_loop()
        next_refresh = loop.time()  # the first pass indexes the store at once
        while True:
            while len(self._jobs) < MAX_PARALLEL_DOWNLOADS:
                job = await _claim_next_job(node_name=agent.name)
                if job is None:
                    break
                log.info("download %s: %s claimed by %s", job.pk, job.repo_id, agent.name)
                task = asyncio.create_task(run_download_job(job.pk, node_name=agent.name), name=f"download-{job.pk}")
                self._jobs.add(task)
                task.add_done_callback(self._jobs.discard)
            if loop.time() >= next_refresh:
                next_refresh = loop.time() + INDEX_REFRESH_S
                try:
                    await run_db(services.refresh_index)
                except Exception:
                    log.warning("store index refresh failed", exc_info=True)
            await asyncio.sleep(JOB_POLL_S)

    async def stop(self, agent) -> None:
        for task in list(self._jobs):
            task.cancel()
        if self._jobs:
            await asyncio.gather(*self._jobs, return_exceptions=True)


__all__ = ["HubWorker"]
