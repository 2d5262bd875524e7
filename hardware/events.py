"""Live fragments for the GPUs page (typed wrapper around live.publish).

An agent that starts sends the whole list (its node may be new); its refreshes send only its
own card and the summary, so a large cluster does not re-send every card every few seconds.
"""
from __future__ import annotations

from django.template.loader import render_to_string

from hardware.allocation import node_card, overview
from hardware.models import Node
from history.samples import RANGES, dashboard_group
from live.db import run_db
from live.publish import publish

GPUS_GROUP = "gpus"
NODES_ELEMENT_ID = "gpu-nodes"
SUMMARY_ELEMENT_ID = "gpu-summary"


def node_element_id(node: Node) -> str:
    """The id of a node's card on the GPUs page."""
    return f"node-{node.pk}"


def render_gpu_nodes(*, oob: bool) -> str:
    """The summary and every node card, as the #gpu-nodes element (out-of-band for websockets)."""
    return render_to_string("hardware/partials/_nodes.html", {"overview": overview(), "oob": oob})


def render_node_update(node_name: str) -> list[tuple[str, str]]:
    """(element id, out-of-band html) for one node's card and the summary counts."""
    node = Node.objects.prefetch_related("gpus").get(name=node_name)
    card = render_to_string("hardware/partials/_node_card.html", {"card": node_card(node), "card_oob": True})
    summary = render_to_string("hardware/partials/_summary.html", {"overview": overview(), "summary_oob": True})
    return [(node_element_id(node), card), (SUMMARY_ELEMENT_ID, summary)]


async def publish_gpus() -> None:
    """Send every node card to every browser on the GPUs page."""
    html = await run_db(render_gpu_nodes, oob=True)
    await publish(GPUS_GROUP, html, key=NODES_ELEMENT_ID)


async def publish_node(node_name: str) -> None:
    """Send one node's refreshed card and the summary to every browser on the GPUs page."""
    for key, html in await run_db(render_node_update, node_name):
        await publish(GPUS_GROUP, html, key=key)


async def publish_dashboard_node(node_name: str) -> None:
    """Send one node's panel, with its newest sample, to every dashboard open (per range)."""
    from hardware.dashboard import render_node_panel

    for rng in RANGES.values():
        key, html = await run_db(render_node_panel, node_name, rng)
        await publish(dashboard_group(rng.name), html, key=key)
