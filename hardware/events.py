"""Live fragments for the GPUs page (typed wrapper around xgenconsole.live.publish)."""
from __future__ import annotations

from asgiref.sync import sync_to_async
from django.template.loader import render_to_string

from hardware.allocation import overview
from xgenconsole.live import publish

GPUS_GROUP = "gpus"
NODES_ELEMENT_ID = "gpu-nodes"


def render_gpu_nodes(*, oob: bool) -> str:
    """The summary and every node card, as the #gpu-nodes element (out-of-band for websockets)."""
    return render_to_string("hardware/partials/_nodes.html", {"overview": overview(), "oob": oob})


async def publish_gpus() -> None:
    """Send the current node cards to every browser on the GPUs page."""
    html = await sync_to_async(render_gpu_nodes)(oob=True)
    await publish(GPUS_GROUP, html, key=NODES_ELEMENT_ID)
