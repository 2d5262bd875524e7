"""Model instances (a served model on a node) and their state history."""
from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class InstanceType(models.TextChoices):
    LLM = "llm"
    EMBEDDING = "embedding"


class InstanceState(models.TextChoices):
    PENDING = "PENDING"
    CACHING = "CACHING"
    LOADING = "LOADING"
    WARMING = "WARMING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    STOPPED = "STOPPED"
    ERROR = "ERROR"


class DesiredState(models.TextChoices):
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"


# States in which an instance holds (or is about to hold) a name, a port and GPUs.
ACTIVE_STATES = (
    InstanceState.PENDING,
    InstanceState.CACHING,
    InstanceState.LOADING,
    InstanceState.WARMING,
    InstanceState.READY,
    InstanceState.UNLOADING,
)


class ModelInstance(models.Model):
    model_name = models.CharField(max_length=255, help_text="served name clients put in `model`")
    model_path = models.CharField(max_length=1024, help_text="store prefix or absolute path on the node")
    artifact = models.ForeignKey("hub.ModelArtifact", null=True, blank=True, on_delete=models.SET_NULL)
    type = models.CharField(max_length=16, choices=InstanceType.choices, default=InstanceType.LLM)
    backend = models.CharField(max_length=64)
    backend_reason = models.TextField(blank=True)
    node = models.ForeignKey("hardware.Node", on_delete=models.PROTECT, related_name="instances")
    gpus = models.JSONField(default=list, blank=True)  # [index, ...] on the node
    tensor_parallel_size = models.IntegerField(default=1)
    extra_args = models.JSONField(default=dict, blank=True)
    autostart = models.BooleanField(default=False)
    desired_state = models.CharField(max_length=16, choices=DesiredState.choices, default=DesiredState.RUNNING)
    state = models.CharField(max_length=16, choices=InstanceState.choices, default=InstanceState.PENDING)
    state_message = models.CharField(max_length=500, blank=True)
    progress_pct = models.FloatField(null=True, blank=True)
    port = models.IntegerField(null=True, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    pgid = models.IntegerField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    restarts = models.IntegerField(default=0)
    restart_requested = models.BooleanField(default=False, help_text="an operator asked for a restart")
    last_error = models.TextField(blank=True)
    log_tail = models.JSONField(default=list, blank=True)
    estimated_memory_mib = models.BigIntegerField(null=True, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["state", "model_name"])]

    def __str__(self) -> str:
        return f"{self.model_name}#{self.pk}"

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def live_version(self) -> int:
        """Orders live fragments of this instance: a newer row state has a larger number."""
        return int(self.updated_at.timestamp() * 1_000_000)

    @property
    def upstream_base(self) -> str:
        """Where the proxy reaches this backend."""
        return f"http://{self.node.address}:{self.port}"


class InstanceEvent(models.Model):
    """One state transition of an instance; the timeline on its page."""

    instance = models.ForeignKey(ModelInstance, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(default=timezone.now)
    from_state = models.CharField(max_length=16, blank=True)
    to_state = models.CharField(max_length=16)
    message = models.TextField(blank=True)

    class Meta:
        ordering = ["at", "pk"]


class UsageBucket(models.Model):
    """Inference usage in one hour, per key, user, model, instance and node; summed by every web
    process (serving.usage writes them in batches). Names are kept as they were (the rows outlive
    keys, users and instances)."""

    bucket_start = models.DateTimeField(help_text="the hour (UTC) the requests finished in")
    key_id = models.IntegerField(default=0, help_text="0: a browser session, not a key")
    key_name = models.CharField(max_length=100, blank=True)
    username = models.CharField(max_length=150, blank=True)
    model = models.CharField(max_length=255)
    instance_id = models.IntegerField(default=0)
    node = models.CharField(max_length=255, blank=True)
    requests = models.BigIntegerField(default=0)
    errors = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    busy_seconds = models.FloatField(default=0.0, help_text="this key's share of the instance's busy time")

    class Meta:
        constraints = [models.UniqueConstraint(
            fields=["bucket_start", "key_id", "username", "model", "instance_id", "node"], name="usage_bucket_unique")]
        indexes = [models.Index(fields=["key_id", "bucket_start"]), models.Index(fields=["bucket_start"])]


class RequestLog(models.Model):
    """One proxied request (never its prompt or answer); pruned after XGEN_REQUEST_LOG_DAYS."""

    at = models.DateTimeField(db_index=True)
    request_id = models.CharField(max_length=128, db_index=True)
    key_id = models.IntegerField(default=0)
    key_name = models.CharField(max_length=100, blank=True)
    username = models.CharField(max_length=150, blank=True)
    model = models.CharField(max_length=255, blank=True)
    instance_id = models.IntegerField(null=True, blank=True)
    node = models.CharField(max_length=255, blank=True)
    status = models.IntegerField()
    error = models.CharField(max_length=64, blank=True, help_text="the error code, when there was one")
    ttft_ms = models.FloatField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    prompt_tokens = models.IntegerField(default=0)
    completion_tokens = models.IntegerField(default=0)
    stream = models.BooleanField(default=False)
    client = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["-at", "-pk"]
        indexes = [models.Index(fields=["key_id", "at"]), models.Index(fields=["model", "at"])]
