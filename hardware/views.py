"""GPU allocation pages: the overview of every node and GPU, and one node's detail. A team lead
below operator sees only the nodes and GPUs its teams' models hold (hardware.allocation's
visibility source); another node answers 404, as one that does not exist."""
from __future__ import annotations

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from accounts.auth import role_required
from accounts.models import Role
from hardware.allocation import node_card, overview, visible_instances
from hardware.dashboard import gpu_panel
from hardware.models import Node
from history.samples import DEFAULT_RANGE, RANGES


@role_required(Role.VIEWER)
def gpus_page(request: HttpRequest) -> HttpResponse:
    """Every node, its GPUs, memory and holders; htmx polls get only the node cards. A scoped lead's
    page polls instead of listening (the live cards are every node's)."""
    visible = visible_instances(request.user)
    context = {"overview": overview(visible), "oob": False, "scoped": visible is not None}
    if request.htmx:
        return render(request, "hardware/partials/_nodes.html", context)
    return render(request, "hardware/gpus.html", context)


@role_required(Role.VIEWER)
def node_detail(request: HttpRequest, name: str) -> HttpResponse:
    """One node: backends, GPUs, detection report, per-GPU history (?range=) and recent heartbeats."""
    node = get_object_or_404(Node.objects.prefetch_related("gpus"), name=name)
    visible = visible_instances(request.user)
    card = node_card(node, visible=visible)
    if visible is not None and not card.gpus:
        raise Http404("No such node.")
    rng = RANGES.get(request.GET.get("range", DEFAULT_RANGE), RANGES[DEFAULT_RANGE])
    only = None if visible is None else {row.gpu.index for row in card.gpus}
    return render(request, "hardware/node_detail.html",
                  {"card": card, "node": node, "heartbeats": node.heartbeats.all()[:60],
                   "history": gpu_panel(node, rng, only=only), "range": rng, "ranges": list(RANGES)})
