"""The request log keeps XGEN_REQUEST_LOG_DAYS of rows; the node agent prunes the rest."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from serving.models import RequestLog
from serving.node.agent import default_workers
from serving.node.workers import RequestLogPruner, prune_request_log


@pytest.mark.django_db
def test_rows_older_than_the_retention_are_pruned(settings):
    settings.REQUEST_LOG_DAYS = 14
    now = timezone.now()
    for days in (0, 13, 15, 30):
        RequestLog.objects.create(at=now - timedelta(days=days), request_id=f"r{days}", status=200)
    assert prune_request_log(batch=1) == 2
    assert sorted(RequestLog.objects.values_list("request_id", flat=True)) == ["r0", "r13"]
    assert prune_request_log() == 0


def test_every_node_agent_prunes():
    assert sum(isinstance(w, RequestLogPruner) for w in default_workers()) == 1
