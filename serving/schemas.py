"""Request and response bodies of the management API (see /work/shared/api.md)."""
from __future__ import annotations

from datetime import datetime

from ninja import Field, Schema


class LoadIn(Schema):
    model_path: str = Field(..., max_length=1024)
    model_name: str | None = Field(None, max_length=128)
    server_type: str = Field("llm", description="llm, embedding or rerank (llama-server "
                             "--reranking, vLLM's scoring runner: /v1/rerank and /v1/score only)")
    backend: str | None = "auto"
    node: str | None = Field(None, max_length=100)
    gpus: list[int] | None = Field(None, max_length=64)
    tensor_parallel_size: int | None = Field(None, ge=1, le=64)
    extra_args: dict[str, str | int | float | bool | None] | None = Field(None, max_length=64)
    autostart: bool = False
    fallback: bool | None = Field(None, description="when the backend does not come up, try another backend of "
                                  "the node once; default: yes for backend auto, no for a backend named")
    aliases: list[str] | None = Field(None, max_length=16, description="more names that route like model_name")


class LoadOut(Schema):
    id: int
    model_name: str
    state: str
    backend: str
    backend_reason: str
    node: str
    gpus: list[int]


class InstanceRef(Schema):
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
