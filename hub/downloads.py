"""Running one Hugging Face download job: the child process, live progress, then the upload.

Runs on a node agent's event loop (hub.worker.HubWorker). The child (`hub.hf_download`) does
the Hub traffic; this side watches the destination folder for bytes, polls the job row for a
cancel request, kills the child to cancel, and uploads the result to the store with the
manifest last. Every exit path leaves the job in a final state and removes the temp folder.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

from django.conf import settings
from django.db import close_old_connections

from hub import writes
from hub.events import publish_job
from hub.jobs import download as download_jobs
from hub.models import DownloadJob, DownloadStatus
from hub.store import ModelStore, get_store
from live.db import db_async

log = logging.getLogger("xgen.hub.downloads")

POLL_S = 0.4
CHILD_WORKERS = 4


class JobCancelled(Exception):
    pass


# Through the one DB bridge (the agent lives for days, across database restarts).
_get_job = db_async(lambda job_id: DownloadJob.objects.get(pk=job_id))
_update = db_async(download_jobs.update_job)
_finish = db_async(download_jobs.finish_job)


def _staging_name(path: str) -> str:
    """huggingface_hub (2.x, local_dir mode) writes `<name>` to
    `.cache/huggingface/download/<dir>/<urlsafe-b64(sha1("<name>.metadata"))>.<etag>.incomplete`."""
    name = Path(path).name + ".metadata"
    return base64.urlsafe_b64encode(hashlib.sha1(name.encode()).digest()).decode()


def _file_progress(dest: Path, files: list[dict]) -> list[dict]:
    """Bytes on disk per wanted file: the final file, or huggingface_hub's `.incomplete` one."""
    staging = dest / ".cache" / "huggingface" / "download"
    out = []
    for f in files:
        final = dest / f["path"]
        done = 0
        if final.is_file():
            done = final.stat().st_size
        else:
            rel = Path(f["path"])
            folder = staging / rel.parent
            if folder.is_dir():
                for pattern in (f"{_staging_name(f['path'])}.*.incomplete", f"{rel.name}*.incomplete"):
                    for part in folder.glob(pattern):
                        try:
                            done = max(done, part.stat().st_size)
                        except OSError:
                            pass
        out.append({"path": f["path"], "size": f["size"], "done": min(done, f["size"] or done)})
    return out


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def _run_child(job: DownloadJob, dest: Path) -> list[dict]:
    """Run the child to completion; returns the file list. Raises JobCancelled or RuntimeError."""
    cmd = [sys.executable, "-m", "hub.hf_download", "--repo", job.repo_id, "--dest", str(dest),
           "--workers", str(CHILD_WORKERS)]
    if job.revision:
        cmd += ["--revision", job.revision]
    for pattern in job.allow_patterns or []:
        cmd += ["--allow", pattern]
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HOME": str(dest.parent / f"{dest.name}-hfhome")}
    env.pop("HF_HUB_OFFLINE", None)  # this child exists to go online; model processes stay offline
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        cwd=settings.BASE_DIR, start_new_session=True)
    stdout, stderr = proc.stdout, proc.stderr
    assert stdout is not None and stderr is not None  # both piped
    try:  # supervised like a backend: the agent that restarts after a kill -9 stops it (download_jobs.fail_orphaned_jobs)
        await _update(job.pk, pid=proc.pid, pgid=proc.pid)
    except BaseException:
        _kill(proc)
        await proc.wait()
        raise
    files: list[dict] = []
    error: str | None = None
    stderr_tail: list[bytes] = []

    async def read_stdout() -> None:
        nonlocal files, error
        async for raw in stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            if event.get("event") == "files":
                files = event["files"]
                total = sum(int(f["size"] or 0) for f in files)
                await _update(job.pk, bytes_total=total, files=[{**f, "done": 0} for f in files])
            elif event.get("event") == "error":
                error = event.get("message") or "download failed"

    async def read_stderr() -> None:
        async for raw in stderr:
            stderr_tail.append(raw)
            del stderr_tail[:-20]

    readers = [asyncio.create_task(read_stdout()), asyncio.create_task(read_stderr())]
    last_done = -1
    try:
        while proc.returncode is None:
            try:
                async with asyncio.timeout(POLL_S):  # not wait_for: see live/groups.py
                    await proc.wait()
            except TimeoutError:
                pass
            current = await _get_job(job.pk)
            if current.cancel_requested:
                raise JobCancelled()
            if files:
                per_file = await asyncio.to_thread(_file_progress, dest, files)
                done = sum(f["done"] for f in per_file)
                if done != last_done:
                    last_done = done
                    await publish_job(await _update(job.pk, bytes_done=done, files=per_file))
        await asyncio.gather(*readers)
    except BaseException:
        _kill(proc)
        await proc.wait()
        for r in readers:
            r.cancel()
        raise
    if proc.returncode != 0:
        if error:
            raise RuntimeError(error)
        last_lines = b"".join(stderr_tail).decode(errors="replace").strip().splitlines()
        raise RuntimeError(f"The download process exited with {proc.returncode}: {(last_lines or ['no output'])[-1]}")
    return files


async def run_download_job(job_id: int, *, node_name: str, store: ModelStore | None = None) -> DownloadJob:
    """Download a claimed job (status DOWNLOADING) and upload it to the store; returns the final job."""
    job = await _get_job(job_id)
    store = store or get_store()
    dest, hf_home = download_jobs.download_dirs(job.pk)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True, exist_ok=True)
    cancel = threading.Event()
    try:
        await publish_job(job)
        files = await _run_child(job, dest)
        total = sum(int(f["size"] or 0) for f in files)
        job = await _update(job.pk, status=DownloadStatus.UPLOADING, bytes_done=0, bytes_total=total,
                            files=[{**f, "done": f["size"]} for f in files])
        await publish_job(job)
        loop = asyncio.get_running_loop()
        progress_state = {"done": 0}

        def on_upload(done: int, _total: int) -> None:
            progress_state["done"] = done

        # The rule checked when the job was made, again now that it writes (the job holds the lock).
        await asyncio.to_thread(_in_thread(lambda: download_jobs.check_download_target(
            job.target_prefix, repo_id=job.repo_id, replace=job.replace, store=store)))
        upload = loop.run_in_executor(None, _in_thread(lambda: writes.write_model(
            job.target_prefix, dest, store=store, progress=on_upload, cancel=cancel, replace=job.replace,
            source={"repo_id": job.repo_id, "revision": job.revision or "main"}, source_repo=job.repo_id,
            source_revision=job.revision or "main")))
        last = -1
        try:
            while not upload.done():
                await asyncio.wait([upload], timeout=POLL_S)
                current = await _get_job(job.pk)
                if current.cancel_requested:
                    cancel.set()
                if progress_state["done"] != last:
                    last = progress_state["done"]
                    await publish_job(await _update(job.pk, bytes_done=min(last, total)))
        except BaseException:
            # Stop the write (within a read); it cleans up after itself (writes.after_failed_write).
            cancel.set()
            await asyncio.wait([upload], timeout=30)
            raise
        try:
            upload.result()  # written and indexed; a failure was re-indexed by write_model itself
        except Exception:
            if cancel.is_set():
                raise JobCancelled() from None
            raise
        await _update(job.pk, bytes_done=total)
        job = await _finish(job.pk, status=DownloadStatus.COMPLETED)
    except JobCancelled:
        job = await _finish(job.pk, status=DownloadStatus.CANCELLED, error="Cancelled by a user.")
    except asyncio.CancelledError:
        cancel.set()
        await _finish(job.pk, status=DownloadStatus.FAILED, error="The node agent stopped during this download.")
        raise
    except Exception as exc:
        log.warning("download %s (%s) failed: %s", job.number, job.repo_id, exc)
        message = str(exc) or exc.__class__.__name__
        job = await _finish(job.pk, status=DownloadStatus.FAILED, error=message)
    finally:
        await asyncio.to_thread(shutil.rmtree, dest, True)
        await asyncio.to_thread(shutil.rmtree, hf_home, True)
    await publish_job(job)
    return job


def _in_thread(fn):
    """fn for an executor thread: fresh DB connections before, closed after (the agent lives for days)."""

    def call():
        close_old_connections()
        try:
            return fn()
        finally:
            close_old_connections()

    return call
