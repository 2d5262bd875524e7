"""The hub's jobs, one lifecycle for every kind (`hub.models.Job`: uploads, downloads, node-cache
jobs): created PENDING by a web request, claimed by one agent (a conditional UPDATE), progress
while active, a cancel asked by a user, and one final state that is never left. Upload and
download jobs hold their model's write lock (`hub.locks`) from creation to that final state.

`upload` and `download` hold each kind's own steps; running a job on the agent is `hub.uploads`
/ `hub.downloads` / `hub.node_cache.run_cache_job`."""
from __future__ import annotations

from typing import Any

from django.utils import timezone

from hub.locks import unlock_prefix
from hub.models import Job, JobStatus


def holder(job: Job) -> str:
    """The job's name as a write-lock holder: `<kind>:<number>`."""
    return f"{job.kind}:{job.number}"


def get(model: type[Job], job_id: int) -> Job:
    return model.objects.select_related("created_by").get(pk=job_id)


def claim_next(model: type[Job], *, node_name: str, any_node: bool = False) -> Job | None:
    """Take the oldest PENDING job of this node (of any node with `any_node`, which then becomes
    the job's); a conditional UPDATE makes sure only one agent gets it."""
    pending = model.objects.filter(status=JobStatus.PENDING)
    if not any_node:
        pending = pending.filter(node=node_name)
    for job_id in pending.order_by("created_at", "pk").values_list("pk", flat=True)[:5]:
        fields = {"status": model.RUNNING_STATE, "started_at": timezone.now(), **({"node": node_name} if any_node else {})}
        if model.objects.filter(pk=job_id, status=JobStatus.PENDING).update(**fields):
            return get(model, job_id)
    return None


def update(model: type[Job], job_id: int, **fields: Any) -> Job:
    """Write progress or a state change of an active job; a finished job is never reopened (a
    late write of a runner that lost a race with a cancel or an agent's restart changes nothing)."""
    model.objects.filter(pk=job_id, status__in=model.ACTIVE).update(**fields)
    return get(model, job_id)


def finish(model: type[Job], job_id: int, *, status: str, error: str = "", **fields: Any) -> Job:
    """Move an active job to a final state (COMPLETED, FAILED, CANCELLED) and free its model's
    write lock; a job already final is left as it is."""
    model.objects.filter(pk=job_id, status__in=model.ACTIVE).update(
        status=status, error=error[:4000], finished_at=timezone.now(), **model.ON_FINISH, **fields)
    job = get(model, job_id)
    if model.HOLDS_LOCK:
        unlock_prefix(job.target_prefix, holder=holder(job))
    return job


def request_cancel(job: Job) -> Job:
    """Ask a job to stop. One no agent has claimed yet is cancelled (and its lock freed) at once;
    a running one stops at its agent's next look (within a second)."""
    model = type(job)
    if model.objects.filter(pk=job.pk, status=JobStatus.PENDING).update(
            status=JobStatus.CANCELLED, cancel_requested=True, finished_at=timezone.now(),
            error="Cancelled before it started."):
        if model.HOLDS_LOCK:
            unlock_prefix(job.target_prefix, holder=holder(job))
    else:
        model.objects.filter(pk=job.pk, status__in=model.ACTIVE).update(cancel_requested=True)
    return get(model, job.pk)


__all__ = ["claim_next", "finish", "get", "holder", "request_cancel", "update"]
