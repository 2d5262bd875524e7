"""What serving tells the hardware pages: which instances are active and which GPUs they hold."""
from __future__ import annotations

from hardware.allocation import Holder
from hardware.models import Node
from serving.models import ACTIVE_STATES, ModelInstance


def active_holders(node: Node | None = None) -> list[tuple[int, list[int], Holder]]:
    """(node id, GPU indexes, holder) for every active instance, of `node` or of every node (one query)."""
    qs = ModelInstance.objects.filter(state__in=ACTIVE_STATES).only("id", "node_id", "gpus", "model_name", "state")
    if node is not None:
        qs = qs.filter(node=node)
    return [(inst.node_id, list(inst.gpus or []), Holder(id=inst.pk, model_name=inst.model_name, state=inst.state))
            for inst in qs]
