"""Small formatting filters for the hub's pages."""
from __future__ import annotations

from django import template

register = template.Library()


@register.filter
def job_percent(job) -> int:
    """Whole percent of a download job (100 once COMPLETED)."""
    if job.status == "COMPLETED":
        return 100
    if not job.bytes_total:
        return 0
    return max(0, min(100, int(100 * job.bytes_done / job.bytes_total)))


@register.filter
def file_percent(entry: dict) -> int:
    size = entry.get("size") or 0
    return 100 if not size else max(0, min(100, int(100 * (entry.get("done") or 0) / size)))


@register.filter
def job_speed(job) -> str:
    """Average speed and time left of an active job, e.g. '12.3 MB/s · 40 s left'."""
    from django.template.defaultfilters import filesizeformat
    from django.utils import timezone

    if job.status not in ("DOWNLOADING", "UPLOADING") or not job.started_at or not job.bytes_done:
        return ""
    elapsed = (timezone.now() - job.started_at).total_seconds()
    if elapsed <= 0:
        return ""
    rate = job.bytes_done / elapsed
    text = f"{filesizeformat(rate)}/s"
    if job.bytes_total > job.bytes_done and rate > 0:
        left = int((job.bytes_total - job.bytes_done) / rate)
        text += f" · {left // 60} min {left % 60} s left" if left >= 60 else f" · {left} s left"
    return text
