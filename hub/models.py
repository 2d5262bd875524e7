"""The index of the model store, node caches, download and upload jobs, and the per-model write lock."""
from __future__ import annotations

from django.conf import settings
from django.db import models, transaction
from django.urls import reverse
from django.utils import timezone


class ModelFormat(models.TextChoices):
    GGUF = "gguf"
    HUGGINGFACE = "huggingface"
    LORA = "lora", "LoRA adapter"  # loads with its base model (`adapters` of a load), never alone


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
    # A GGUF's architecture keys (layers, width, heads, trained context) read from the store once,
    # with the file and ETag they came from: the load sizes the KV cache and the context from them
    # (serving.control.planning.source_header); a file replaced since is read again.
    model_header = models.JSONField(default=dict, blank=True)

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


class JobKind(models.TextChoices):
    UPLOAD = "upload"
    DOWNLOAD = "download"
    CACHE = "cache"


class JobStatus(models.TextChoices):
    """Every state a job may be in; each kind uses some (`DownloadJob.STATES`, ...)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    DOWNLOADING = "DOWNLOADING"
    UPLOADING = "UPLOADING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


FINAL_STATES = (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


class Job(models.Model):
    """Work a node agent does for a user, of one `kind`: an upload (a local path on a node into the
    store), a download (a Hugging Face repository into the store) or a cache job (evict or verify
    a cached model on a node). One lifecycle for all (`hub.jobs`): created PENDING by a web request,
    claimed by one agent (a conditional UPDATE), progress, cancel, one final state that is never
    left. Each kind is a proxy class below with its states; its fields are blank for the others.

    `number` is the job's id in the API, on the pages and in lock holders, counted per kind: it
    is the primary key for every job made since 0.3 (the ids of upload and cache jobs made before
    were kept as their numbers when the three tables became this one)."""

    kind = models.CharField(max_length=16, choices=JobKind.choices)
    number = models.IntegerField(null=True, blank=True, help_text="the id of the job in its kind's API")
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.PENDING)
    node = models.CharField(max_length=100, blank=True, help_text="the node whose agent runs (or claimed) the job")
    target_prefix = models.CharField(max_length=512, blank=True, help_text="the model the job writes or checks")
    format = models.CharField(max_length=16, choices=ModelFormat.choices, blank=True)
    replace = models.BooleanField(default=False, help_text="may overwrite a complete model")
    bytes_done = models.BigIntegerField(default=0)
    bytes_total = models.BigIntegerField(default=0)
    error = models.TextField(blank=True)
    cancel_requested = models.BooleanField(default=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # download
    repo_id = models.CharField(max_length=255, blank=True)
    revision = models.CharField(max_length=128, blank=True)
    allow_patterns = models.JSONField(default=list, blank=True)
    files = models.JSONField(default=list, blank=True)  # [{"path", "size", "done"}]
    pid = models.IntegerField(null=True, blank=True, help_text="the download child process, while it runs")
    pgid = models.IntegerField(null=True, blank=True, help_text="its process group (stopped as a whole)")
    # upload
    local_path = models.CharField(max_length=4096, blank=True)
    # cache
    action = models.CharField(max_length=16, blank=True)
    result = models.JSONField(default=dict, blank=True)

    KIND = ""
    STATES: tuple[str, ...] = ()  # this kind's states
    ACTIVE: tuple[str, ...] = ()  # the states it can still leave
    RUNNING_STATE = JobStatus.RUNNING  # the state a claim puts it in
    HOLDS_LOCK = False  # holds its target's write lock (PrefixLock) from creation to its end
    ROW_CLASS = "job"
    CANCEL_VIEW = ""  # the page route a row's Cancel button posts to (cancel_url)
    ON_FINISH: dict = {}  # fields a final state resets

    class Meta:
        ordering = ["-created_at", "-pk"]
        constraints = [models.UniqueConstraint(fields=["kind", "number"], name="hub_job_uniq_kind_number")]
        indexes = [models.Index(fields=["kind", "status", "node"], name="hub_job_kind_status_node")]

    def __str__(self) -> str:
        return f"{self.kind} job {self.number}"

    def save(self, *args, **kwargs) -> None:
        if self.KIND:
            self.kind = self.KIND
        if self.pk is not None or self.number is not None:
            super().save(*args, **kwargs)
            return
        with transaction.atomic():  # a new job's number is its primary key
            super().save(*args, **kwargs)
            self.number = self.pk
            Job.objects.filter(pk=self.pk).update(number=self.pk)

    @property
    def is_active(self) -> bool:
        return self.status not in FINAL_STATES

    @property
    def percent(self) -> int:
        if self.status == JobStatus.COMPLETED:
            return 100
        return int(100 * self.bytes_done / self.bytes_total) if self.bytes_total else 0

    @property
    def row_id(self) -> str:
        """The id of the job's row on its page (`ROW_CLASS-number`)."""
        return f"{self.ROW_CLASS}-{self.number}"

    @property
    def cancel_url(self) -> str:
        """Where the Cancel button of the job's row posts (its kind's CANCEL_VIEW)."""
        return reverse(self.CANCEL_VIEW, args=[self.number])


class KindManager(models.Manager):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def get_queryset(self):
        return super().get_queryset().filter(kind=self.kind)


# ---------------------------------------------------------------- the kinds
class DownloadStatus(models.TextChoices):
    PENDING = "PENDING"
    DOWNLOADING = "DOWNLOADING"
    UPLOADING = "UPLOADING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

DOWNLOAD_ACTIVE = (DownloadStatus.PENDING, DownloadStatus.DOWNLOADING, DownloadStatus.UPLOADING)


class DownloadJob(Job):
    """A Hugging Face repository, fetched by any agent's child process and written into the store.
    Holds its target's write lock (PrefixLock) from creation to its end."""

    KIND = JobKind.DOWNLOAD
    STATES = tuple(DownloadStatus.values)
    ACTIVE = DOWNLOAD_ACTIVE
    RUNNING_STATE = JobStatus.DOWNLOADING
    HOLDS_LOCK = True
    ON_FINISH = {"pid": None, "pgid": None}  # the child is gone
    ROW_CLASS = "job"  # its row on the Downloads page: article.job, .job-error, ...
    CANCEL_VIEW = "download-cancel"
    objects = KindManager(JobKind.DOWNLOAD)

    class Meta:
        proxy = True

class UploadStatus(models.TextChoices):
    PENDING = "PENDING"
    UPLOADING = "UPLOADING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

UPLOAD_ACTIVE = (UploadStatus.PENDING, UploadStatus.UPLOADING)


class UploadJob(Job):
    """A local file or folder on a node, to be copied into the store by that node's agent.

    The path is on `node`: only the agent of that node claims the job (a web process may run on
    another host). The job holds the model's write lock (PrefixLock) from creation to its end.
    """

    KIND = JobKind.UPLOAD
    STATES = tuple(UploadStatus.values)
    ACTIVE = UPLOAD_ACTIVE
    RUNNING_STATE = JobStatus.UPLOADING
    HOLDS_LOCK = True
    ROW_CLASS = "upload"  # its row on the Upload page: article.upload, .upload-error, ...
    CANCEL_VIEW = "upload-cancel"
    objects = KindManager(JobKind.UPLOAD)

    class Meta:
        proxy = True

    def __str__(self) -> str:
        return f"upload {self.number}: {self.local_path} -> {self.target_prefix}"


class CacheAction(models.TextChoices):
    EVICT = "evict"
    VERIFY = "verify"


class CacheJobStatus(models.TextChoices):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

CACHE_JOB_ACTIVE = (CacheJobStatus.PENDING, CacheJobStatus.RUNNING)


class CacheJob(Job):
    """Evict or verify a cached model: done by the agent of the node that holds the files."""

    KIND = JobKind.CACHE
    STATES = tuple(CacheJobStatus.values)
    ACTIVE = CACHE_JOB_ACTIVE
    RUNNING_STATE = JobStatus.RUNNING
    ROW_CLASS = "cache-job"  # its row in the node's cache card: article.cache-job, .cache-job-error, ...
    CANCEL_VIEW = "node-cache-cancel"
    objects = KindManager(JobKind.CACHE)

    class Meta:
        proxy = True

    @property
    def prefix(self) -> str:
        return self.target_prefix

    @property
    def cancel_url(self) -> str:
        return reverse(self.CANCEL_VIEW, args=[self.node, self.number])


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
