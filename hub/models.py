"""The index of the model store, node caches, download and upload jobs, and the per-model write lock."""
from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class ModelFormat(models.TextChoices):
    GGUF = "gguf"
    HUGGINGFACE = "huggingface"


class ModelArtifact(models.Model):
    """One model in the store. The store is the truth; this row is its index."""

    prefix = models.CharField(max_length=512, unique=True)  # "gguf/Qwen_Qwen3-4B"
    format = models.CharField(max_length=16, choices=ModelFormat.choices)
    name = models.CharField(max_length=255)
    files = models.JSONField(default=list, blank=True)  # [{"path", "size", "etag"}]
    size_bytes = models.BigIntegerField(default=0)
    file_count = models.IntegerField(default=0)
    complete = models.BooleanField(default=False, help_text="manifest present: loadable")
    source_repo = models.CharField(max_length=255, blank=True)
    source_revision = models.CharField(max_length=64, blank=True)
    indexed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["prefix"]

    def __str__(self) -> str:
        return self.prefix


class CacheState(models.TextChoices):
    MISSING = "MISSING"
    SYNCING = "SYNCING"
    READY = "READY"
    FAILED = "FAILED"


class CacheEntry(models.Model):
    """An artifact copied onto a node's disk."""

    node = models.ForeignKey("hardware.Node", on_delete=models.CASCADE, related_name="cache_entries")
    prefix = models.CharField(max_length=512)
    state = models.CharField(max_length=16, choices=CacheState.choices, default=CacheState.MISSING)
    bytes_done = models.BigIntegerField(default=0)
    bytes_total = models.BigIntegerField(default=0)
    manifest = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    updated_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True, help_text="last sync for a load (LRU eviction)")
    verified_at = models.DateTimeField(null=True, blank=True, help_text="last Verify (sizes and hashes)")
    verify_problems = models.JSONField(default=list, blank=True, help_text="what differed at the last Verify")

    class Meta:
        ordering = ["prefix"]
        constraints = [models.UniqueConstraint(fields=["node", "prefix"], name="uniq_cache_per_node_prefix")]

    @property
    def verified(self) -> bool:
        """The last Verify found the copy equal to the store manifest."""
        return self.verified_at is not None and not self.verify_problems


class CacheDisk(models.Model):
    """A node's cache disk, as its agent last measured it."""

    node = models.OneToOneField("hardware.Node", on_delete=models.CASCADE, related_name="cache_disk")
    used_bytes = models.BigIntegerField(default=0, help_text="bytes of cached models under MODELS_DIR")
    free_bytes = models.BigIntegerField(default=0)
    total_bytes = models.BigIntegerField(default=0)
    max_bytes = models.BigIntegerField(default=0, help_text="XGEN_CACHE_MAX_GB of that agent; 0 = no limit")
    updated_at = models.DateTimeField(default=timezone.now)


class CacheAction(models.TextChoices):
    EVICT = "evict"
    VERIFY = "verify"


class CacheJobStatus(models.TextChoices):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"


class CacheJob(models.Model):
    """Evict or verify a cached model: done by the agent of the node that holds the files."""

    node = models.CharField(max_length=100)
    prefix = models.CharField(max_length=512)
    action = models.CharField(max_length=16, choices=CacheAction.choices)
    status = models.CharField(max_length=16, choices=CacheJobStatus.choices, default=CacheJobStatus.PENDING)
    result = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-pk"]
        indexes = [models.Index(fields=["status", "node"], name="hub_cachejob_status_node")]


class DownloadStatus(models.TextChoices):
    PENDING = "PENDING"
    DOWNLOADING = "DOWNLOADING"
    UPLOADING = "UPLOADING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


DOWNLOAD_ACTIVE = (DownloadStatus.PENDING, DownloadStatus.DOWNLOADING, DownloadStatus.UPLOADING)


class DownloadJob(models.Model):
    repo_id = models.CharField(max_length=255)
    revision = models.CharField(max_length=128, blank=True)
    format = models.CharField(max_length=16, choices=ModelFormat.choices)
    allow_patterns = models.JSONField(default=list, blank=True)
    status = models.CharField(max_length=16, choices=DownloadStatus.choices, default=DownloadStatus.PENDING)
    bytes_done = models.BigIntegerField(default=0)
    bytes_total = models.BigIntegerField(default=0)
    files = models.JSONField(default=list, blank=True)  # [{"path", "size", "done"}]
    error = models.TextField(blank=True)
    target_prefix = models.CharField(max_length=512, blank=True)
    node = models.CharField(max_length=100, blank=True, help_text="agent that claimed the job")
    replace = models.BooleanField(default=False, help_text="may overwrite a complete model downloaded from this repo")
    pid = models.IntegerField(null=True, blank=True, help_text="the download child process, while it runs")
    pgid = models.IntegerField(null=True, blank=True, help_text="its process group (stopped as a whole)")
    cancel_requested = models.BooleanField(default=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    @property
    def percent(self) -> float:
        return 100.0 * self.bytes_done / self.bytes_total if self.bytes_total else 0.0

    @property
    def is_active(self) -> bool:
        return self.status in DOWNLOAD_ACTIVE


class UploadStatus(models.TextChoices):
    PENDING = "PENDING"
    UPLOADING = "UPLOADING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


UPLOAD_ACTIVE = (UploadStatus.PENDING, UploadStatus.UPLOADING)


class UploadJob(models.Model):
    """A local file or folder on a node, to be copied into the store by that node's agent.

    The path is on `node`: only the agent of that node claims the job (a web process may run on
    another host). The job holds the model's write lock (PrefixLock) from creation to its end.
    """

    local_path = models.CharField(max_length=4096)
    format = models.CharField(max_length=16, choices=ModelFormat.choices)
    target_prefix = models.CharField(max_length=512)
    replace = models.BooleanField(default=False, help_text="may overwrite a complete model")
    node = models.CharField(max_length=100, help_text="the node whose agent reads local_path")
    status = models.CharField(max_length=16, choices=UploadStatus.choices, default=UploadStatus.PENDING)
    bytes_done = models.BigIntegerField(default=0)
    bytes_total = models.BigIntegerField(default=0)
    error = models.TextField(blank=True)
    cancel_requested = models.BooleanField(default=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-pk"]
        indexes = [models.Index(fields=["status", "node"], name="hub_upload_status_node")]

    def __str__(self) -> str:
        return f"upload {self.pk}: {self.local_path} -> {self.target_prefix}"

    @property
    def percent(self) -> int:
        if self.status == UploadStatus.COMPLETED:
            return 100
        return int(100 * self.bytes_done / self.bytes_total) if self.bytes_total else 0

    @property
    def is_active(self) -> bool:
        return self.status in UPLOAD_ACTIVE


class PrefixLock(models.Model):
    """One writer per model prefix, across every web process, agent and CLI: the row exists while
    an upload job, a download job, a `manage.py hub_upload` or a delete writes the prefix. Taken by
    INSERT (the unique prefix makes a second one fail), dropped when the writer ends; a row whose
    holder has ended (a job in a final state, a dead CLI process on this host) is taken over."""

    prefix = models.CharField(max_length=512, unique=True)
    holder = models.CharField(max_length=200, help_text="upload:<id>, download:<id>, cli:<host>:<pid>, ...")
    acquired_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.prefix} ({self.holder})"
