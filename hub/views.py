"""Pages: the model browser, Hugging Face downloads, and uploads."""
from __future__ import annotations

from collections import defaultdict

from django.conf import settings
from django.contrib import messages
from django.core.paginator import Paginator
from django.db.models import Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from accounts.audit import record_audit
from accounts.auth import role_required
from accounts.models import Role
from hub import services
from hub.events import publish_new_job
from hub.models import CacheEntry, CacheState, DownloadJob, ModelArtifact
from hub.paths import FORMAT_ROOTS, InvalidPrefix
from hub.store import StoreError
from hub.uploads import recent_uploads, start_upload

PAGE_SIZE = 50


def cached_on_map(prefixes: list[str]) -> dict[str, list[str]]:
    """prefix -> names of the nodes holding a READY copy."""
    out: dict[str, list[str]] = defaultdict(list)
    rows = CacheEntry.objects.filter(prefix__in=prefixes, state=CacheState.READY).values_list("prefix", "node__name")
    for prefix, node in rows:
        out[prefix].append(node)
    return out


@require_http_methods(["GET"])
def models_page(request: HttpRequest) -> HttpResponse:
    """Browse the store index: format filter, search box, pages; Load and (admin) Delete."""
    fmt = request.GET.get("format", "")
    query = request.GET.get("q", "").strip()[:200]
    artifacts = ModelArtifact.objects.all()
    if fmt in FORMAT_ROOTS:
        artifacts = artifacts.filter(format=fmt)
    if query:
        artifacts = artifacts.filter(Q(prefix__icontains=query) | Q(source_repo__icontains=query))
    page = Paginator(artifacts, PAGE_SIZE).get_page(request.GET.get("page"))
    cached = cached_on_map([a.prefix for a in page])
    rows = [(a, sorted(cached.get(a.prefix, []))) for a in page]
    context = {"page": page, "rows": rows, "format": fmt, "q": query, "formats": FORMAT_ROOTS,
               "is_admin": request.user.has_role(Role.ADMIN), "can_upload": request.user.has_role(Role.OPERATOR)}
    template = "hub/partials/_models_table.html" if request.htmx else "hub/models.html"
    return render(request, template, context)


@role_required(Role.ADMIN)
@require_POST
def model_delete(request: HttpRequest) -> HttpResponse:
    """Delete a model from the store (admins; the page asks for confirmation first)."""
    prefix = request.POST.get("prefix", "")
    try:
        removed = services.delete_model(prefix=prefix)
    except InvalidPrefix as exc:
        record_audit(action="model_delete", target=prefix, request=request, outcome="refused", detail={"reason": str(exc)})
        messages.error(request, str(exc))
        return render(request, "hub/message.html", {"title": "Delete refused"}, status=400)
    except StoreError as exc:
        record_audit(action="model_delete", target=prefix, request=request, outcome="failed", detail={"reason": str(exc)})
        messages.error(request, f"The store failed: {exc}")
        return redirect("models")
    record_audit(action="model_delete", target=prefix, request=request, detail={"deleted_objects": removed})
    messages.success(request, f"Deleted {prefix} ({removed} objects).")
    return redirect("models")


@role_required(Role.OPERATOR)
@require_POST
def models_refresh(request: HttpRequest) -> HttpResponse:
    """Re-read the store into the index now."""
    try:
        count = services.refresh_index()
        messages.success(request, f"The store holds {count} models.")
    except StoreError as exc:
        messages.error(request, f"The store failed: {exc}")
    return redirect("models")


@role_required(Role.OPERATOR)
@require_http_methods(["GET", "POST"])
def upload_page(request: HttpRequest) -> HttpResponse:
    """Upload a file or folder on the web server's host into the store, with live progress (only paths
    `services.check_import_path` allows: under XGEN_IMPORT_DIRS, outside the console's own dirs)."""
    form = {"local_path": "", "format": "gguf", "name": ""}
    status = 200
    if request.method == "POST":
        form = {k: request.POST.get(k, "").strip() for k in form}
        target = f"{form['format']}/{form['name']} from {form['local_path']}"
        try:
            upload = start_upload(**form, user=request.user.username)
        except (InvalidPrefix, services.HubInputError) as exc:
            record_audit(action="upload", target=target, request=request, outcome="refused", detail={"reason": str(exc)})
            messages.error(request, str(exc))
            status = 400
        else:
            record_audit(action="upload", target=target, request=request)
            messages.success(request, f"Uploading {upload.local_path} as {upload.prefix}.")
            return redirect("model-upload")
    return render(request, "hub/upload.html", {"form": form, "formats": FORMAT_ROOTS, "uploads": recent_uploads(),
                                               "import_dirs": [str(d) for d in settings.IMPORT_DIRS]}, status=status)


@require_http_methods(["GET", "POST"])
def downloads_page(request: HttpRequest) -> HttpResponse:
    """Start Hugging Face downloads (operators) and watch every job live."""
    form = {"repo_id": "", "revision": "", "format": "huggingface", "allow_patterns": ""}
    status = 200
    if request.method == "POST":
        if not request.user.has_role(Role.OPERATOR):
            messages.error(request, "Starting a download needs the operator role.")
            status = 403
        else:
            form = {k: request.POST.get(k, "").strip() for k in form}
            patterns = [p.strip() for p in form["allow_patterns"].replace("\n", ",").split(",") if p.strip()]
            try:
                job = services.create_download_job(repo_id=form["repo_id"], revision=form["revision"] or None,
                                                   format=form["format"], allow_patterns=patterns, user=request.user)
            except (InvalidPrefix, services.HubInputError) as exc:
                record_audit(action="download", target=form["repo_id"], request=request, outcome="refused",
                             detail={"reason": str(exc)})
                messages.error(request, str(exc))
                status = 400
            else:
                record_audit(action="download", target=job.repo_id, request=request,
                             detail={"job": job.pk, "revision": job.revision, "format": job.format})
                publish_new_job(job)
                messages.success(request, f"Download of {job.repo_id} queued.")
                return redirect("downloads")
    jobs = DownloadJob.objects.all()[:100]
    return render(request, "hub/downloads.html",
                  {"jobs": jobs, "form": form, "formats": FORMAT_ROOTS,
                   "can_download": request.user.has_role(Role.OPERATOR)}, status=status)


@role_required(Role.OPERATOR)
@require_POST
def download_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    """Cancel a job: the agent kills its child process and cleans up."""
    job = services.request_cancel(job=get_object_or_404(DownloadJob, pk=pk))
    if request.htmx:
        return HttpResponse(status=204)
    messages.info(request, f"Cancel requested for {job.repo_id}.")
    return redirect("downloads")
