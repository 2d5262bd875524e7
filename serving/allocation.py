"""What serving tells the hardware pages: which instances are active and which GPUs they hold."""
from __future__ import annotations

from hardware.allocation import Holder
from hardware.models import Node
from hub.node_cache import CacheUser
from serving.models import ACTIVE_STATES, ModelInstance


def active_holders(node: Node | None = None) -> list[tuple[int, list[int], Holder]]:
    """(node id, GPU indexes, holder) for every active instance, of `node` or of every node (one query)."""
    qs = ModelInstance.objects.filter(state__in=ACTIVE_STATES).only("id", "node_id", "gpus", "model_name", "state",
                                                                    "estimated_memory_mib")
    if node is not None:
        qs = qs.filter(node=node)
    return [(inst.node_id, list(inst.gpus or []),
             Holder(id=inst.pk, model_name=inst.model_name, state=inst.state,
                    memory_mib=(inst.estimated_memory_mib or 0) // max(1, len(inst.gpus or []))))
            for inst in qs]


def cache_users(node_name: str) -> dict[str, list]:
    """{store prefix: [CacheUser]} for the active instances of a node (hub.node_cache's users source)."""
    out: dict[str, list] = {}
    qs = ModelInstance.objects.filter(state__in=ACTIVE_STATES, node__name=node_name).only("id", "model_path",
                                                                                        "model_name", "state")
    for inst in qs:
        if not inst.model_path.startswith("/"):
            out.setdefault(inst.model_path.strip("/"), []).append(
                CacheUser(id=inst.pk, model_name=inst.model_name, state=inst.state))
    return out
