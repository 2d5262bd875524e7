from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from serving.models import ModelInstance


def instances_page(request: HttpRequest) -> HttpResponse:
    return render(request, "serving/instances.html", {"instances": ModelInstance.objects.select_related("node")[:200]})


def instance_detail(request: HttpRequest, pk: int) -> HttpResponse:
    inst = get_object_or_404(ModelInstance.objects.select_related("node"), pk=pk)
    return render(request, "serving/instance_detail.html", {"inst": inst})
