"""The model store and download API (see /work/shared/api.md)."""
from __future__ import annotations

from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from ninja import Query, Router, Schema, Status

from accounts.audit import record_audit
from accounts.auth import admin_auth, operator_auth, require_role
from accounts.errors import ApiError
from hub import index, node_cache, writes
from hub.events import publish_job_sync, publish_new_job
from hub.imports import HubInputError
from hub.jobs import download as download_jobs
from hub.jobs import request_cancel
from hub.jobs import upload as upload_jobs
from hub.locks import PrefixBusy
from hub.models import CacheJob, DownloadJob, ModelArtifact, UploadJob
from hub.paths import FORMAT_ROOTS, InvalidPrefix, validate_relative_path
from hub.schemas import (
    CacheActionIn,
    CacheJobOut,
    DeletedOut,
    DownloadIn,
    DownloadJobOut,
    ModelPageOut,
    NodeCacheOut,
    RefreshOut,
    UploadIn,
    UploadJobOut,
)
from hub.store import ModelExists, StoreError
from hub.views import cached_on_map

storage_router = Router()
download_router = Router()

PAGE_SIZE = 100


def _bad_input(exc: Exception) -> ApiError:
    return ApiError(400, str(exc), code="invalid_path" if isinstance(exc, InvalidPrefix) else "invalid_request")


def _store_failed(exc: StoreError) -> ApiError:
    return ApiError(502, f"The model store failed: {exc}", code="store_unavailable")


def _conflict(exc: Exception) -> ApiError:
    code = ("name_collision" if isinstance(exc, download_jobs.NameCollision) else
            "model_exists" if isinstance(exc, ModelExists) else "model_busy")
    return ApiError(409, str(exc), code=code)


class ModelQuery(Schema):
    prefix: str = ""
    page: int = 1


def _clean_filter(prefix: str) -> str:
    """A listing filter may be partial (`gguf/`, `gguf/Qw`) but never a traversal."""
    if not prefix:
        return ""
    validate_relative_path(prefix.rstrip("/") or "/", what="prefix filter")
    if prefix.split("/", 1)[0] not in FORMAT_ROOTS and not any(r.startswith(prefix) for r in FORMAT_ROOTS):
        raise InvalidPrefix(f"The prefix filter must start with gguf/, huggingface/ or lora/, not {prefix!r}.")
    return prefix


@storage_router.get("/models", response=ModelPageOut, summary="Models in the store (paginated)")
def list_models(request: HttpRequest, query: Query[ModelQuery]):
    try:
        prefix = _clean_filter(query.prefix)
    except InvalidPrefix as exc:
        raise _bad_input(exc) from None
    if query.page < 1:
        raise ApiError(400, "page must be 1 or more.", code="invalid_request")
    rows = ModelArtifact.objects.filter(prefix__startswith=prefix).only(
        "prefix", "format", "size_bytes", "file_count", "complete", "source_repo")
    start = (query.page - 1) * PAGE_SIZE
    page = list(rows[start : start + PAGE_SIZE + 1])
    has_next = len(page) > PAGE_SIZE
    page = page[:PAGE_SIZE]
    cached = cached_on_map([a.prefix for a in page])
    items = [{"prefix": a.prefix, "format": a.format, "size_bytes": a.size_bytes, "file_count": a.file_count,
              "complete": a.complete, "cached_on": sorted(cached.get(a.prefix, [])), "source_repo": a.source_repo}
             for a in page]
    return {"items": items, "next": query.page + 1 if has_next else None}


@storage_router.post("/refresh", response=RefreshOut, auth=operator_auth,
                     summary="Re-read the store into the index (operator+)")
def refresh(request: HttpRequest):
    require_role(request, "operator")
    try:
        return {"models": index.refresh_index()}
    except StoreError as exc:
        raise _store_failed(exc) from None


@storage_router.delete("/models/{path:prefix}", response=DeletedOut, auth=admin_auth, summary="Delete a model (admin)")
def delete_model(request: HttpRequest, prefix: str):
    require_role(request, "admin")
    try:
        removed = writes.delete_model(prefix=prefix)
    except InvalidPrefix as exc:
        record_audit(action="model_delete", target=prefix, request=request, outcome="refused", detail={"reason": str(exc)})
        raise _bad_input(exc) from None
    except PrefixBusy as exc:
        record_audit(action="model_delete", target=prefix, request=request, outcome="refused", detail={"reason": str(exc)})
        raise _conflict(exc) from None
    except StoreError as exc:
        record_audit(action="model_delete", target=prefix, request=request, outcome="failed", detail={"reason": str(exc)})
        raise _store_failed(exc) from None
    record_audit(action="model_delete", target=prefix, request=request, detail={"deleted_objects": removed})
    return {"prefix": prefix.rstrip("/"), "deleted_objects": removed}


def _upload_out(job: UploadJob) -> dict:
    return {
        "id": job.number, "status": job.status, "bytes_done": job.bytes_done, "bytes_total": job.bytes_total,
        "error": job.error or None, "prefix": job.target_prefix, "format": job.format, "local_path": job.local_path,
        "node": job.node, "replace": job.replace, "created_by": job.created_by.username if job.created_by else None,
        "created_at": job.created_at, "started_at": job.started_at, "finished_at": job.finished_at,
    }


@storage_router.post("/upload", response={202: UploadJobOut}, auth=operator_auth,
                     summary="Queue an upload of a file or folder on a node (operator+)")
def upload(request: HttpRequest, body: UploadIn):
    """Checks the path now (400 before any job exists), then the node's agent copies it into the store:
    poll `GET /api/storage/uploads/{id}`. 409 `model_exists` for a name the store already holds as a
    complete model (unless `replace`), 409 `model_busy` while another upload or download writes it."""
    user = require_role(request, "operator")
    target = f"{body.format}/{body.name} from {body.local_path}"
    try:
        job = upload_jobs.create_upload_job(local_path=body.local_path, format=body.format, name=body.name,
                                         node=body.node, replace=body.replace, user=user)
    except (InvalidPrefix, HubInputError) as exc:
        record_audit(action="upload", target=target, request=request, outcome="refused", detail={"reason": str(exc)})
        raise _bad_input(exc) from None
    except (ModelExists, PrefixBusy) as exc:
        record_audit(action="upload", target=target, request=request, outcome="refused", detail={"reason": str(exc)})
        raise _conflict(exc) from None
    except StoreError as exc:
        record_audit(action="upload", target=target, request=request, outcome="failed", detail={"reason": str(exc)})
        raise _store_failed(exc) from None
    record_audit(action="upload", target=target, request=request,
                 detail={"job": job.number, "node": job.node, "prefix": job.target_prefix})
    publish_new_job(job)
    return Status(202, _upload_out(job))


@storage_router.get("/uploads", response=list[UploadJobOut], summary="Recent upload jobs")
def list_uploads(request: HttpRequest):
    return [_upload_out(j) for j in UploadJob.objects.select_related("created_by")[:100]]


@storage_router.get("/uploads/{job_id}", response=UploadJobOut, summary="One upload job")
def get_upload(request: HttpRequest, job_id: int):
    return _upload_out(get_object_or_404(UploadJob.objects.select_related("created_by"), number=job_id))


@storage_router.post("/uploads/{job_id}/cancel", response=UploadJobOut, auth=operator_auth,
                     summary="Cancel an upload (operator+)")
def cancel_upload(request: HttpRequest, job_id: int):
    require_role(request, "operator")
    job = upload_jobs.request_upload_cancel(job=get_object_or_404(UploadJob, number=job_id))
    publish_job_sync(job)
    return _upload_out(job)


def _job_out(job: DownloadJob) -> dict:
    return {
        "id": job.number, "repo_id": job.repo_id, "revision": job.revision, "format": job.format, "status": job.status,
        "bytes_done": job.bytes_done, "bytes_total": job.bytes_total, "error": job.error or None,
        "target_prefix": job.target_prefix, "allow_patterns": job.allow_patterns or [], "files": job.files or [],
        "node": job.node, "replace": job.replace, "created_at": job.created_at, "finished_at": job.finished_at,
    }


@download_router.post("", response={202: DownloadJobOut}, auth=operator_auth,
                      summary="Start a Hugging Face download (operator+)")
def start_download(request: HttpRequest, body: DownloadIn):
    """409 `model_exists` for a model the store already holds from this repo (unless `replace`),
    409 `name_collision` when the name made from the repo id holds a model of another origin (an
    upload, or a repo id that makes the same name), 409 `model_busy` while another job writes it."""
    user = require_role(request, "operator")
    try:
        job = download_jobs.create_download_job(repo_id=body.repo_id, revision=body.revision, format=body.format,
                                           allow_patterns=body.allow_patterns, replace=body.replace, user=user)
    except (InvalidPrefix, HubInputError) as exc:
        record_audit(action="download", target=body.repo_id, request=request, outcome="refused",
                     detail={"reason": str(exc)})
        raise _bad_input(exc) from None
    except (ModelExists, PrefixBusy) as exc:
        record_audit(action="download", target=body.repo_id, request=request, outcome="refused",
                     detail={"reason": str(exc)})
        raise _conflict(exc) from None
    except StoreError as exc:
        record_audit(action="download", target=body.repo_id, request=request, outcome="failed",
                     detail={"reason": str(exc)})
        raise _store_failed(exc) from None
    record_audit(action="download", target=body.repo_id, request=request,
                 detail={"job": job.number, "revision": job.revision, "format": job.format})
    publish_new_job(job)
    return Status(202, _job_out(job))


@download_router.get("", response=list[DownloadJobOut], summary="Recent download jobs")
def list_downloads(request: HttpRequest):
    return [_job_out(j) for j in DownloadJob.objects.all()[:100]]


@download_router.get("/{job_id}", response=DownloadJobOut, summary="One download job")
def get_download(request: HttpRequest, job_id: int):
    return _job_out(get_object_or_404(DownloadJob, number=job_id))


@download_router.post("/{job_id}/cancel", response=DownloadJobOut, auth=operator_auth,
                      summary="Cancel a download (operator+)")
def cancel_download(request: HttpRequest, job_id: int):
    require_role(request, "operator")
    job = download_jobs.request_cancel(job=get_object_or_404(DownloadJob, number=job_id))
    publish_job_sync(job)
    return _job_out(job)


# --------------------------------------------------------------------------- node caches
# Mounted at /api/hardware/nodes (the node's URL), owned by the hub (which owns caches).
cache_router = Router()


def _node_or_404(name: str):
    from hardware.models import Node

    node = Node.objects.filter(name=name).first()
    if node is None:
        raise ApiError(404, f"No node {name!r}.", code="not_found")
    return node


def _cache_job_out(job: CacheJob) -> dict:
    return {"id": job.number, "node": job.node, "prefix": job.target_prefix, "action": job.action, "status": job.status,
            "result": job.result or {}, "error": job.error or None, "created_at": job.created_at,
            "finished_at": job.finished_at}


@cache_router.get("/{name}/cache", response=NodeCacheOut, summary="A node's cache: disk and cached models")
def node_cache_view(request: HttpRequest, name: str):
    return node_cache.overview(_node_or_404(name))


def _cache_job(request: HttpRequest, name: str, body: CacheActionIn, action: str) -> CacheJob:
    require_role(request, "operator")
    node = _node_or_404(name)
    try:
        job = node_cache.request_cache_job(node=node, prefix=body.prefix, action=action, user=request.user)
    except InvalidPrefix as exc:
        raise _bad_input(exc) from None
    except LookupError as exc:
        raise ApiError(404, str(exc), code="not_found") from None
    except node_cache.CacheInUse as exc:
        raise ApiError(409, str(exc), code="model_in_use") from None
    publish_new_job(job)
    return job


@cache_router.post("/{name}/cache/evict", response={202: CacheJobOut}, auth=operator_auth,
                   summary="Evict a cached model from a node (operator+; refused while an instance uses it)")
def node_cache_evict(request: HttpRequest, name: str, body: CacheActionIn):
    return Status(202, _cache_job_out(_cache_job(request, name, body, "evict")))


@cache_router.post("/{name}/cache/verify", response={202: CacheJobOut}, auth=operator_auth,
                   summary="Re-check a cached model's sizes and hashes against the store manifest (operator+)")
def node_cache_verify(request: HttpRequest, name: str, body: CacheActionIn):
    return Status(202, _cache_job_out(_cache_job(request, name, body, "verify")))


@cache_router.get("/{name}/cache/jobs/{job_id}", response=CacheJobOut, summary="One evict/verify job and its result")
def node_cache_job(request: HttpRequest, name: str, job_id: int):
    return _cache_job_out(get_object_or_404(CacheJob, number=job_id, node=name))


@cache_router.post("/{name}/cache/jobs/{job_id}/cancel", response=CacheJobOut, auth=operator_auth,
                   summary="Cancel an evict/verify job (operator+): a pending one at once, a verify before its next file")
def cancel_node_cache_job(request: HttpRequest, name: str, job_id: int):
    require_role(request, "operator")
    job = request_cancel(get_object_or_404(CacheJob, number=job_id, node=name))
    publish_job_sync(job)
    return _cache_job_out(job)
