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
