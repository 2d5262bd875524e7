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


class NodeOut(Schema):
    name: str
    address: str
    status: str
    last_heartbeat: datetime | None
    draining_since: datetime | None = Field(None, description="when its agent began draining (SIGTERM): "
                                                              "nothing new is placed on it; null: not draining")
    backends: list[str]
    gpus: list[GpuOut]
