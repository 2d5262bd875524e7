"""Request and response bodies of the management API (see /work/shared/api.md)."""
from __future__ import annotations

from datetime import datetime
from typing import Literal

from ninja import Field, Schema

from accounts.bodies import StrictBody


class LoadIn(StrictBody):
    model_path: str = Field(..., max_length=1024)
    model_name: str | None = Field(None, max_length=128)
    server_type: str = Field("llm", description="llm, embedding or rerank (llama-server "
                             "--reranking, vLLM's scoring runner: /v1/rerank and /v1/score only)")
    backend: str | None = "auto"
    node: str | None = Field(None, max_length=100)
    gpus: list[int] | None = Field(None, max_length=64)
    tensor_parallel_size: int | None = Field(None, ge=1, le=64)
    extra_args: dict[str, str | int | float | bool | None] | None = Field(None, max_length=64)
    autostart: bool = Field(False, description="start it when its node agent starts (and /readyz waits for it); "
                                                "without it, a clean agent stop leaves it stopped")
    fallback: bool | None = Field(None, description="when the backend does not come up, try another backend of "
                                  "the node once; default: yes for backend auto, no for a backend named")
    aliases: list[str] | None = Field(None, max_length=16, description="more names that route like model_name")
    policy: Literal["always", "on_demand"] = Field("always", description="on_demand: IDLE until a request needs it")
    idle_ttl_s: int | None = Field(None, ge=0, le=10**7, description="on_demand: unloaded after this long unused; "
                                                                      "0 = never (default XGEN_IDLE_TTL_S)")
    pinned: bool = Field(False, description="never evicted to make room")
    max_concurrency: int | None = Field(None, ge=1, le=100000,
                                        description="requests one replica serves at once; more wait in the queue")
    first_byte_timeout_s: int | None = Field(None, ge=1, le=86400, description="the proxy's wait (s) for the "
                                             "first byte of an answer's body, then 504 upstream_timeout (a long "
                                             "prefill needs more); default XGEN_PROXY_FIRST_BYTE_TIMEOUT")
    start: bool | None = Field(None, description="on_demand: start now instead of on the first request")


class LoadOut(Schema):
    id: int
    model_name: str
    state: str
    backend: str
    backend_reason: str
    node: str
    gpus: list[int]
    policy: str = "always"
    idle_ttl_s: int = 0
    pinned: bool = False
    max_concurrency: int | None = None
    first_byte_timeout_s: int | None = None
    autostart: bool = False


class InstanceRef(StrictBody):
    id: int | None = None
    model_name: str | None = Field(None, max_length=128)


class InstanceMemory(Schema):
    estimate_mib: int | None = Field(None, description="the plan's figure (a measurement of the same load shape "
                                     "when one was recorded, else the estimate)")
    measured_mib: int | None = Field(None, description="what the backend held once READY; null until measured")
    measured_source: str | None = Field(None, description="nvml or amdsmi (GPU memory of its processes), rss (RAM)")


class InstanceOut(Schema):
    id: int
    model_name: str
    model_path: str
    type: str
    state: str
    state_message: str
    progress_pct: float | None
    desired_state: str
    backend: str
    backend_reason: str
    node: str
    gpus: list[int]
    port: int | None
    pid: int | None
    restarts: int
    error: str
    exit_code: int | None
    extra_args: dict
    ready_at: datetime | None
    created_at: datetime
    log_tail: list[str]
    memory: InstanceMemory
    command: list[str] | None = None
    policy: str = "always"
    idle_ttl_s: int = 0
    pinned: bool = False
    max_concurrency: int | None = None
    first_byte_timeout_s: int | None = None
    autostart: bool = False
    last_request_at: datetime | None = None
    idle_unload_at: datetime | None = None
