from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from hardware.models import Node


def gpus_page(request: HttpRequest) -> HttpResponse:
    nodes = Node.objects.prefetch_related("gpus")
    return render(request, "hardware/gpus.html", {"nodes": nodes})


def node_detail(request: HttpRequest, name: str) -> HttpResponse:
    node = get_object_or_404(Node, name=name)
    return render(request, "hardware/node_detail.html", {"node": node, "heartbeats": node.heartbeats.all()[:60]})
