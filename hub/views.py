from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from hub.models import DownloadJob, ModelArtifact


def models_page(request: HttpRequest) -> HttpResponse:
    return render(request, "hub/models.html", {"artifacts": ModelArtifact.objects.filter(complete=True)})


def downloads_page(request: HttpRequest) -> HttpResponse:
    return render(request, "hub/downloads.html", {"jobs": DownloadJob.objects.all()[:100]})
