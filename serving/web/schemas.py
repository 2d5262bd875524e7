"""Request and response bodies of the management API (see /work/shared/api.md)."""
from __future__ import annotations

from datetime import datetime
from typing import Literal

from ninja import Field, Schema

from accounts.bodies import StrictBody


class AdapterIn(StrictBody):
    """A LoRA adapter loaded with the model (issue 27), served as `<model_name>:<name>`."""

    name: str = Field(..., max_length=64, description="a-z 0-9 . _ -; served as <model_name>:<name>")
    path: str = Field(..., max_length=1024, description="absolute path under the allowed model dirs: a LoRA "
                      "GGUF (llama-server) or a PEFT folder (vLLM)")
    scale: float | None = Field(1.0, ge=-16, le=16, description="the strength a request for it gets "
                                "(a request may give its own `lora_scale`)")


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
    adapters: list[AdapterIn] | None = Field(None, max_length=16, description="LoRA adapters: each a served "
                                             "model <model_name>:<name> on the base's instance (llama-server, vLLM)")
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
    replicas: int = Field(1, ge=1, le=16, description="instances of the model, each planned and placed as a load: "
                          "on GPUs no other replica holds (other GPUs first, then other nodes); on a CPU node, "
                          "separate processes on separate ports")
    partial: bool = Field(False, description="when not all replicas fit: start as many as fit (else 409 "
                                             "does_not_fit and nothing is loaded)")
    drain_timeout_s: int | None = Field(None, ge=0, le=3600, description="a replica scaled down waits at most this "
                                        "long for its requests in flight (default 30)")
    preset: str | None = Field(None, max_length=64, description="the model's engine preset of this name (issue 27 "
                               "#3); left out: its default preset, if any; \"none\": no preset")


class ReplicaOut(Schema):
    id: int
    replica: int
    node: str
    gpus: list[int]
    state: str
    port: int | None = None


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
    replica: int = 0
    replicas: list[ReplicaOut] = Field(default_factory=list, description="every replica this load placed")
    replicas_wanted: int = 1
    partial: bool = Field(False, description="fewer replicas than asked fit (`partial`: true): `refused` says why")
    refused: list[str] = Field(default_factory=list)


class ScaleIn(StrictBody):
    model_name: str = Field(..., max_length=128)
    replicas: int = Field(..., ge=1, le=16, description="the replica count wanted (unload stops them all)")
    partial: bool = Field(False, description="scaling up, when not all fit: start as many as fit (else 409 "
                                             "does_not_fit and nothing changes)")
    drain_timeout_s: int | None = Field(None, ge=0, le=3600, description="scaling down: how long a replica may "
                                        "finish its requests in flight before it is stopped (default: the "
                                        "model's, 30)")


class ScaleOut(Schema):
    model_name: str
    previous: int = Field(..., description="replicas before")
    replicas: int = Field(..., description="the desired count now")
    wanted: int
    partial: bool
    started: list[int] = Field(..., description="instances placed for it (PENDING)")
    draining: list[int] = Field(..., description="instances out of routing, stopped once their requests are done")
    refused: list[str]
    instances: list[ReplicaOut] = Field(..., description="every replica holding the name now")


class AutoscaleIn(StrictBody):
    model_name: str = Field(..., max_length=128)
    min_replicas: int = Field(1, ge=0, le=16, description="the floor (0: the last replica is left to on_demand's "
                              "idle unload, a request starts one again)")
    max_replicas: int = Field(..., ge=1, le=16, description="the ceiling (never more than fits)")
    target_in_flight: float | None = Field(..., gt=0, le=10000, description="requests in flight plus queued per "
                                           "replica to aim at, over every web process; null turns autoscaling off")
    scale_up_window_s: int = Field(30, ge=1, le=3600, description="load above the target this long adds replicas "
                                   "(default 30 s: Fireworks' scale-up window)")
    scale_down_delay_s: int = Field(600, ge=1, le=86400, description="load below the target this long removes "
                                    "replicas (default 600 s: Fireworks' 10 min scale-down window)")


class ScalingDecisionOut(Schema):
    at: datetime
    model_name: str
    from_replicas: int
    to_replicas: int
    reason: str


class AutoscaleOut(Schema):
    model_name: str
    replicas: int
    min_replicas: int
    max_replicas: int
    target_in_flight: float | None
    scale_up_window_s: int
    scale_down_delay_s: int
    enabled: bool
    decisions: list[ScalingDecisionOut] = Field(..., description="the autoscaler's last 50 changes, newest first")


class RolloutIn(StrictBody):
    model_name: str = Field(..., max_length=128)
    extra_args: dict[str, str | int | float | bool | None] | None = Field(
        None, max_length=64, description="the new engine settings (null: the ones it has; the backend version is "
                                         "the node's now either way)")
    drain_timeout_s: int | None = Field(None, ge=0, le=3600, description="how long each replica may finish its "
                                        "requests in flight before its restart (default: the model's, 30)")


class RolloutOut(Schema):
    model_name: str
    order: list[int] = Field(..., description="the replicas' instance ids, in the order they restart")
    extra_args: dict | None


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
    preset: dict | None = None
    adapters: list[dict] = []
    model_path: str
    type: str
    state: str
    state_message: str
    progress_pct: float | None = Field(None, description="CACHING: the copy from the store; PENDING: the llama.cpp "
                                                         "build the start waits for (percent)")
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
    replica: int = 0
    replicas_desired: int | None = Field(None, description="the served name's desired replica count")
    drain_until: datetime | None = Field(None, description="scaled down: stopped by then at the latest")


class PresetIn(StrictBody):
    model_path: str = Field(..., max_length=1024, description="the store prefix or absolute path it is for")
    name: str = Field(..., max_length=64, description="a-z 0-9 . _ - (not 'none')")
    settings: dict = Field(..., description="context_size, parallel, kv_cache_type, flash_attention, "
                           "tool_call_parser, reasoning_parser, chat_template, speculative")
    default: bool = Field(False, description="applied to a load of the model that names no preset")


class PresetRef(StrictBody):
    model_path: str = Field(..., max_length=1024)
    name: str = Field(..., max_length=64)


class PresetCheck(Schema):
    backend: str
    version: str
    nodes: list[str]
    ok: bool
    message: str


class PresetOut(Schema):
    model_path: str
    name: str
    settings: dict
    default: bool
    updated_at: datetime
    updated_by: str | None
    engines: list[PresetCheck]


class AdapterAddIn(StrictBody):
    model_name: str = Field(..., max_length=128, description="the loaded model (its served name)")
    name: str = Field(..., max_length=64, description="a-z 0-9 . _ -; served as <model_name>:<name>")
    path: str = Field(..., max_length=1024, description="absolute path under the allowed model dirs: a LoRA GGUF "
                      "(llama-server) or a PEFT folder (vLLM)")
    scale: float | None = Field(1.0, ge=-16, le=16)


class AdapterChangeOut(Schema):
    model_name: str
    adapter: str
    applied: Literal["runtime", "rolling_restart"]
    replicas: list[int]
