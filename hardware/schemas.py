from datetime import datetime

from ninja import Field, Schema


class GpuOut(Schema):
    index: int
    uuid: str
    vendor: str
    type: str
    name: str
    memory_total_mib: int
    memory_used_mib: int
    utilization_pct: float | None
    instance_id: int | None


class LlamaBuildOut(Schema):
    version: str = Field(description="llama-cpp-python's version, whose vendored llama.cpp is built")
    state: str = Field(description="building | failed")
    percent: int | None = Field(None, description="CMake's own progress of the phase; null while it configures")
    phase: str = Field("", description="libraries (libllama and the ggml libraries, which llama-cpp-python can "
                                       "use as soon as they are built), then llama-server")
    libraries_ready: bool = Field(False, description="a CPU build's libraries are staged: llama-cpp-python "
                                                     "serves while llama-server compiles")
    flavour: str
    started: float = Field(description="Unix time the compile started (building) or failed (failed)")
    error: str
    label: str = Field(description='what the pages show, e.g. "llama.cpp 0.3.36 building: llama-server 45 % (its '
                                   'libraries are ready)"')


class NodeOut(Schema):
    name: str
    address: str
    status: str
    last_heartbeat: datetime | None
    draining_since: datetime | None = Field(None, description="when its agent began draining (SIGTERM): "
                                                              "nothing new is placed on it; null: not draining")
    backends: list[str]
    llama_build: LlamaBuildOut | None = Field(None, description="the llama.cpp build running (or failed) on the "
                                                                "node; null when none: loads of llama-server and "
                                                                "llama-cpp-python wait for a running one")
    gpus: list[GpuOut]
