"""What serving tells the hardware pages: which instances are active and which GPUs they hold."""
from __future__ import annotations

from hardware.allocation import Holder
from hardware.models import Node
from hub.node_cache import CacheUser
from serving.models import ACTIVE_STATES, ModelInstance


def active_holders(node: Node | None = None) -> list[tuple[int, list[int], Holder]]:
    """(node id, GPU indexes, holder) for every active instance, of `node` or of every node (one query)."""
    qs = ModelInstance.objects.filter(state__in=ACTIVE_STATES)
    if node is not None:
        qs = qs.filter(node=node)
    # values_list, not model instances: the GPUs page asks for every active instance (bench/pages.py)
    return [(node_id, list(gpus or []),
             Holder(id=pk, model_name=name, state=state, memory_mib=(estimate or 0) // max(1, len(gpus or []))))
            for pk, node_id, gpus, name, state, estimate in
            qs.values_list("id", "node_id", "gpus", "model_name", "state", "estimated_memory_mib")]


def cache_users(node_name: str) -> dict[str, list]:
    """{store prefix: [CacheUser]} for the active instances of a node (hub.node_cache's users source):
    the model each loads, and its LoRA adapters from the store (vLLM reads one again when it is
    added at runtime; a restart reads them all)."""
    out: dict[str, list] = {}
    qs = ModelInstance.objects.filter(state__in=ACTIVE_STATES, node__name=node_name).only(
        "id", "model_path", "model_name", "state", "adapters")
    for inst in qs:
        user = CacheUser(id=inst.pk, model_name=inst.model_name, state=inst.state)
        paths = [inst.model_path, *(str(a.get("path", "")) for a in inst.adapters or [] if isinstance(a, dict))]
        for path in paths:
            if path and not path.startswith("/"):
                out.setdefault(path.strip("/"), []).append(user)
    return out
