from django.http import HttpRequest
from ninja import Router

from hardware.models import Node
from hardware.schemas import NodeOut

router = Router()


def gpu_holders(node: Node) -> dict[int, int]:
    """GPU index -> id of the active instance holding it, for one node."""
    from serving.models import ACTIVE_STATES  # read-only lookup of the layer above

    holders: dict[int, int] = {}
    for inst in node.instances.filter(state__in=ACTIVE_STATES).only("id", "gpus"):
        for index in inst.gpus or []:
            holders[int(index)] = inst.pk
    return holders


@router.get("/nodes", response=list[NodeOut], summary="Nodes and their GPUs")
def list_nodes(request: HttpRequest):
    out = []
    for node in Node.objects.prefetch_related("gpus"):
        holders = gpu_holders(node)
        out.append(
            {
                "name": node.name,
                "address": node.address,
                "status": node.status,
                "last_heartbeat": node.last_heartbeat,
                "backends": node.backend_names,
                "gpus": [
                    {
                        "index": g.index,
                        "uuid": g.uuid,
                        "vendor": g.vendor,
                        "type": g.type,
                        "name": g.name,
                        "memory_total_mib": g.memory_total_mib,
                        "memory_used_mib": g.memory_used_mib,
                        "utilization_pct": g.utilization_pct,
                        "instance_id": holders.get(g.index),
                    }
                    for g in node.gpus.all()
                ],
            }
        )
    return out
