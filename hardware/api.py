from django.http import HttpRequest
from ninja import Router

from hardware.allocation import gpu_holders
from hardware.models import Node
from hardware.schemas import NodeOut

router = Router()


@router.get("/nodes", response=list[NodeOut], summary="Nodes and their GPUs")
def list_nodes(request: HttpRequest) -> list[dict]:
    """Every registered node with its status, available backends and GPUs (and who holds each)."""
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
                        "instance_id": holders[g.index].id if g.index in holders else None,
                    }
                    for g in node.gpus.all()
                ],
            }
        )
    return out
