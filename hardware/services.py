"""Writes for nodes: registration and heartbeats (called by the node agent)."""
from __future__ import annotations

import os
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from hardware.models import Heartbeat, Node

HEARTBEAT_HISTORY = timedelta(hours=1)


def register_node(*, name: str, address: str) -> Node:
    """Create or update this agent's node row and mark it alive now."""
    now = timezone.now()
    node, _ = Node.objects.update_or_create(
        name=name,
        defaults={"address": address, "started_at": now, "last_heartbeat": now, "agent_pid": os.getpid()},
    )
    return node


def record_heartbeat(*, name: str, instances_running: int = 0) -> Node:
    """Refresh the heartbeat; keep a short history for the node page."""
    now = timezone.now()
    with transaction.atomic():
        Node.objects.filter(name=name).update(last_heartbeat=now)
        node = Node.objects.get(name=name)
        Heartbeat.objects.create(
            node=node,
            at=now,
            gpu_count=node.gpus.count(),
            memory_used_mib=node.memory_used_mib,
            instances_running=instances_running,
        )
        Heartbeat.objects.filter(node=node, at__lt=now - HEARTBEAT_HISTORY).delete()
    return node
