from typing import Any

from django.http import HttpRequest
from ninja import Router

from hardware.allocation import GpuRow, NodeCard, overview, visible_instances
from hardware.schemas import NodeOut

router = Router()


def _gpu_out(row: GpuRow) -> dict[str, Any]:
    gpu = row.gpu
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "vendor": gpu.vendor,
        "type": gpu.type,
        "name": gpu.name,
        "memory_total_mib": gpu.memory_total_mib,
        "memory_used_mib": gpu.memory_used_mib,
        "utilization_pct": gpu.utilization_pct,
        "instance_id": row.holder.id if row.holder else None,
    }


def _node_out(card: NodeCard) -> dict[str, Any]:
    node = card.node
    return {
        "name": node.name,
        "address": node.address,
        "status": card.status,
        "last_heartbeat": node.last_heartbeat,
        "draining_since": node.draining_since,
        "backends": node.backend_names,
        "llama_build": node.llama_build,
        "gpus": [_gpu_out(row) for row in card.gpus],
    }


@router.get("/nodes", response=list[NodeOut], summary="Nodes and their GPUs")
def list_nodes(request: HttpRequest) -> list[dict[str, Any]]:
    """Every registered node with its status, available backends and GPUs (and who holds each); a
    team lead below operator gets only the nodes and GPUs its teams' models hold."""
    user = getattr(request, "auth", None) or request.user
    return [_node_out(card) for card in overview(visible_instances(user)).cards]
