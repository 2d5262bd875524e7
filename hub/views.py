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
from hub import index, node_cache, writes
from hub.events import publish_job_sync, publish_new_job
from hub.imports import HubInputError
from hub.jobs import download as download_jobs
from hub.jobs import request_cancel
from hub.jobs import upload as upload_jobs
from hub.locks import PrefixBusy
from hub.models import CacheEntry, CacheJob, CacheState, DownloadJob, ModelArtifact, UploadJob
from hub.paths import FORMAT_ROOTS, InvalidPrefix
from hub.store import ModelExists, StoreError

PAGE_SIZE = 50
RECENT_CACHE_JOBS = 10  # a node's cache card lists its jobs: every active one, else the last ones


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
        removed = writes.delete_model(prefix=prefix)
    except InvalidPrefix as exc:
        record_audit(action="model_delete", target=prefix, request=request, outcome="refused", detail={"reason": str(exc)})
        messages.error(request, str(exc))
        return render(request, "hub/message.html", {"title": "Delete refused"}, status=400)
    except PrefixBusy as exc:
        record_audit(action="model_delete", target=prefix, request=request, outcome="refused", detail={"reason": str(exc)})
        messages.error(request, str(exc))
        return render(request, "hub/message.html", {"title": "Delete refused"}, status=409)
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
        count = index.refresh_index()
        messages.success(request, f"The store holds {count} models.")
    except StoreError as exc:
        messages.error(request, f"The store failed: {exc}")
    return redirect("models")


RECENT_UPLOADS = 50


def _node_choices() -> list[str]:
    from hardware.models import Node

    names = list(Node.objects.values_list("name", flat=True))
    return names if settings.NODE_NAME in names else [settings.NODE_NAME, *names]


@role_required(Role.OPERATOR)
@require_http_methods(["GET", "POST"])
def upload_page(request: HttpRequest) -> HttpResponse:
    """Queue an upload of a file or folder on a node into the store, and watch every upload live (the
    jobs are in the database, so any web process shows them). Only paths `hub.imports.check_import_path`
    allows: under XGEN_IMPORT_DIRS, outside the console's own dirs."""
    form = {"local_path": "", "format": "gguf", "name": "", "node": settings.NODE_NAME, "replace": False}
    status = 200
    if request.method == "POST":
        form = {k: request.POST.get(k, "").strip() for k in ("local_path", "format", "name", "node")}
        form["replace"] = request.POST.get("replace") in ("1", "on", "true")
        target = f"{form['format']}/{form['name']} from {form['local_path']}"
        try:
            job = upload_jobs.create_upload_job(**form, user=request.user)
        except (InvalidPrefix, HubInputError) as exc:
            record_audit(action="upload", target=target, request=request, outcome="refused", detail={"reason": str(exc)})
            messages.error(request, str(exc))
            status = 400
        except (ModelExists, PrefixBusy) as exc:
            record_audit(action="upload", target=target, request=request, outcome="refused", detail={"reason": str(exc)})
            messages.error(request, str(exc))
            status = 409
        except StoreError as exc:
            messages.error(request, f"The store failed: {exc}")
            status = 502
        else:
            record_audit(action="upload", target=target, request=request,
                         detail={"job": job.number, "node": job.node, "prefix": job.target_prefix})
            publish_new_job(job)
            messages.success(request, f"Upload of {job.local_path} as {job.target_prefix} queued on {job.node}.")
            return redirect("model-upload")
    uploads = UploadJob.objects.select_related("created_by")[:RECENT_UPLOADS]
    return render(request, "hub/upload.html", {"form": form, "formats": FORMAT_ROOTS, "uploads": uploads,
                                               "nodes": _node_choices(), "this_node": settings.NODE_NAME,
                                               "import_dirs": [str(d) for d in settings.IMPORT_DIRS]}, status=status)


@role_required(Role.OPERATOR)
@require_POST
def upload_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    """Cancel an upload: its agent stops the copy; nothing of it stays listed as complete."""
    job = upload_jobs.request_upload_cancel(job=get_object_or_404(UploadJob, number=pk))
    publish_job_sync(job)  # a job no agent had claimed is CANCELLED now: every open page shows it
    if request.htmx:
        return HttpResponse(status=204)
    messages.info(request, f"Cancel requested for the upload to {job.target_prefix}.")
    return redirect("model-upload")


@require_http_methods(["GET", "POST"])
def downloads_page(request: HttpRequest) -> HttpResponse:
    """Start Hugging Face downloads (operators) and watch every job live."""
    form: dict = {"repo_id": "", "revision": "", "format": "huggingface", "allow_patterns": ""}
    status = 200
    if request.method == "POST":
        if not request.user.has_role(Role.OPERATOR):
            messages.error(request, "Starting a download needs the operator role.")
            status = 403
        else:
            form = {k: request.POST.get(k, "").strip() for k in form}
            form["replace"] = request.POST.get("replace") in ("1", "on", "true")
            patterns = [p.strip() for p in form["allow_patterns"].replace("\n", ",").split(",") if p.strip()]
            try:
                job = download_jobs.create_download_job(repo_id=form["repo_id"], revision=form["revision"] or None,
                                                   format=form["format"], allow_patterns=patterns,
                                                   replace=form["replace"], user=request.user)
            except (InvalidPrefix, HubInputError) as exc:
                record_audit(action="download", target=form["repo_id"], request=request, outcome="refused",
                             detail={"reason": str(exc)})
                messages.error(request, str(exc))
                status = 400
            except (ModelExists, PrefixBusy) as exc:
                record_audit(action="download", target=form["repo_id"], request=request, outcome="refused",
                             detail={"reason": str(exc)})
                messages.error(request, str(exc))
                status = 409
            except StoreError as exc:
                record_audit(action="download", target=form["repo_id"], request=request, outcome="failed",
                             detail={"reason": str(exc)})
                messages.error(request, f"The model store failed: {exc}")
                status = 502
            else:
                record_audit(action="download", target=job.repo_id, request=request,
                             detail={"job": job.number, "revision": job.revision, "format": job.format})
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
    job = download_jobs.request_cancel(job=get_object_or_404(DownloadJob, number=pk))
    publish_job_sync(job)  # a job no agent had claimed is CANCELLED now: every open page shows it
    if request.htmx:
        return HttpResponse(status=204)
    messages.info(request, f"Cancel requested for {job.repo_id}.")
    return redirect("downloads")


def _node_cache_card(request: HttpRequest, name: str, *, error: str = "") -> HttpResponse:
    from hardware.models import Node

    node = get_object_or_404(Node, name=name)
    cache = node_cache.overview(node)
    recent = list(CacheJob.objects.filter(node=node.name).select_related("created_by")[:RECENT_CACHE_JOBS])
    context = {"cache": cache, "node_name": node.name, "can_act": request.user.has_role(Role.OPERATOR),
               "pending": any(m["pending"] for m in cache["models"]), "error": error, "jobs": recent}
    return render(request, "hub/partials/_node_cache.html" if request.htmx else "hub/node_cache.html", context)


@require_http_methods(["GET"])
def node_cache_card(request: HttpRequest, name: str) -> HttpResponse:
    """The node page's cache card (fetched by htmx; also a plain page without JS)."""
    return _node_cache_card(request, name)


@role_required(Role.OPERATOR)
@require_POST
def node_cache_action(request: HttpRequest, name: str, action: str) -> HttpResponse:
    """Queue an Evict or a Verify for the node's agent; the card polls until it is done."""
    from hardware.models import Node

    node = get_object_or_404(Node, name=name)
    error = ""
    try:
        job = node_cache.request_cache_job(node=node, prefix=request.POST.get("prefix", ""), action=action,
                                           user=request.user)
    except (InvalidPrefix, LookupError, node_cache.CacheInUse) as exc:
        error = str(exc)
    else:
        publish_new_job(job)
    if not request.htmx:
        (messages.error if error else messages.success)(request, error or f"{action.title()} queued for the agent of {name}.")
        return redirect("node-detail", name=name)
    return _node_cache_card(request, name, error=error)  # 200 either way: htmx swaps the card and its message


@role_required(Role.OPERATOR)
@require_POST
def node_cache_cancel(request: HttpRequest, name: str, pk: int) -> HttpResponse:
    """Cancel an Evict or a Verify (`hub.jobs.request_cancel`, as a download's or an upload's): one
    the agent has not claimed ends at once, a Verify stops before its next file."""
    job = request_cancel(get_object_or_404(CacheJob, number=pk, node=name))
    publish_job_sync(job)
    if request.htmx:
        return HttpResponse(status=204)
    messages.info(request, f"Cancel requested for the {job.action} of {job.target_prefix}.")
    return redirect("node-detail", name=name)
