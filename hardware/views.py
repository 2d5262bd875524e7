"""GPU allocation pages: the overview of every node and GPU, and one node's detail."""
from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from accounts.auth import role_required
from accounts.models import Role
from hardware.allocation import node_card, overview
from hardware.dashboard import gpu_panel
from hardware.models import Node
from history.samples import DEFAULT_RANGE, RANGES


@role_required(Role.VIEWER)
def gpus_page(request: HttpRequest) -> HttpResponse:
    """Every node, its GPUs, memory and holders; htmx polls get only the node cards."""
    context = {"overview": overview(), "oob": False}
    if request.htmx:
        return render(request, "hardware/partials/_nodes.html", context)
    return render(request, "hardware/gpus.html", context)


@role_required(Role.VIEWER)
def node_detail(request: HttpRequest, name: str) -> HttpResponse:
    """One node: backends, GPUs, detection report, per-GPU history (?range=) and recent heartbeats."""
    node = get_object_or_404(Node.objects.prefetch_related("gpus"), name=name)
    rng = RANGES.get(request.GET.get("range", DEFAULT_RANGE), RANGES[DEFAULT_RANGE])
    return render(request, "hardware/node_detail.html",
                  {"card": node_card(node), "node": node, "heartbeats": node.heartbeats.all()[:60],
                   "history": gpu_panel(node, rng), "range": rng, "ranges": list(RANGES)})
