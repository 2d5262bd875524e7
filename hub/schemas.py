from datetime import datetime
from typing import Any

from ninja import Field, Schema

from accounts.bodies import StrictBody


class StoredModelOut(Schema):
    prefix: str
    format: str
    size_bytes: int
    file_count: int
    complete: bool
    cached_on: list[str]
    source_repo: str = ""


class ModelPageOut(Schema):
    items: list[StoredModelOut]
    next: int | None


class UploadIn(StrictBody):
    local_path: str = Field(..., max_length=4096, description="absolute path on the node, under XGEN_IMPORT_DIRS")
    format: str = Field(..., max_length=32)
    name: str = Field(..., max_length=255)
    node: str | None = Field(None, max_length=100,
                             description="the node the path is on (its agent does the copy); default: this server's")
    replace: bool = Field(False, description="overwrite a complete model of that name (else 409 model_exists)")


class UploadJobOut(Schema):
    id: int
    status: str
    bytes_done: int
    bytes_total: int
    error: str | None
    prefix: str
    format: str
    local_path: str
    node: str
    replace: bool
    created_by: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class DownloadIn(StrictBody):
    repo_id: str = Field(..., max_length=255)
    revision: str | None = Field(None, max_length=128)
    format: str = Field(..., max_length=32)
    allow_patterns: list[str] | None = None
    replace: bool = Field(False, description="replace a complete model downloaded from this repo (else 409 model_exists)")


class DownloadJobOut(Schema):
    id: int
    repo_id: str
    revision: str
    format: str
    status: str
    bytes_done: int
    bytes_total: int
    error: str | None
    target_prefix: str
    allow_patterns: list[str]
    files: list[dict[str, Any]]
    node: str
    replace: bool
    created_at: datetime
    finished_at: datetime | None


class DeletedOut(Schema):
    prefix: str
    deleted_objects: int


class RefreshOut(Schema):
    models: int


class CacheUserOut(Schema):
    id: int
    model_name: str
    state: str


class CachedModelOut(Schema):
    prefix: str
    state: str
    size_bytes: int
    last_used_at: datetime | None
    verified: bool = Field(description="the last Verify found the copy equal to the store manifest")
    verified_at: datetime | None
    verify_problems: list[str] = Field(description="what differed at the last Verify")
    error: str
    used_by: list[CacheUserOut] = Field(description="instances of this node that use the copy (Evict is refused)")
    pending: list[str] = Field(description="evict/verify jobs waiting for the node's agent")
    last_job_error: str = Field(description="why the last evict/verify failed on the agent, if it did")


class NodeCacheOut(Schema):
    node: str
    used_bytes: int
    free_bytes: int
    total_bytes: int
    max_bytes: int = Field(description="XGEN_CACHE_MAX_GB of the node's agent in bytes; 0 = no limit")
    measured_at: datetime | None
    models: list[CachedModelOut]


class CacheActionIn(StrictBody):
    prefix: str = Field(..., max_length=512)


class CacheJobOut(Schema):
    id: int
    node: str
    prefix: str
    action: str
    status: str
    result: dict[str, Any]
    error: str | None
    created_at: datetime
    finished_at: datetime | None
