"""Model instances (a served model on a node), their state history, and the one table of legal
state transitions every state change is checked against.

A state changes only through the `mark_*` methods: each locks the row, checks the move against
TRANSITIONS, writes the row and its InstanceEvent in one transaction, then announces the change
(`instance_changed`: serving.control.events pushes it to every routing table, serving.web.live to
the open pages) after the commit.
"""
from __future__ import annotations

import logging

from django.conf import settings
from django.db import models, transaction
from django.db.models import Q
from django.dispatch import Signal
from django.utils import timezone

log = logging.getLogger("xgen.serving")


class InstanceType(models.TextChoices):
    LLM = "llm"
    EMBEDDING = "embedding"
    RERANK = "rerank"  # llama-server --reranking, vLLM's scoring runner: /v1/rerank, /v1/score


class InstanceState(models.TextChoices):
    PENDING = "PENDING"
    CACHING = "CACHING"
    LOADING = "LOADING"
    WARMING = "WARMING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    STOPPED = "STOPPED"
    ERROR = "ERROR"
    IDLE = "IDLE"  # on_demand: registered, no process, port or memory; starts on the next request


class DesiredState(models.TextChoices):
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"
    IDLE = "IDLE"  # on_demand: stop the backend but keep the instance (idle unload, eviction)


class Policy(models.TextChoices):
    ALWAYS = "always"  # runs until unloaded (a click, as before)
    ON_DEMAND = "on_demand"  # IDLE until a request needs it; unloaded when idle; evictable unless pinned


# States in which an instance holds (or is about to hold) a name, a port and GPUs.
ACTIVE_STATES = (
    InstanceState.PENDING,
    InstanceState.CACHING,
    InstanceState.LOADING,
    InstanceState.WARMING,
    InstanceState.READY,
    InstanceState.UNLOADING,
)

S = InstanceState
# Every legal move: from-state -> the states it may go to. A self-move is a new message on the
# same state (READY -> READY: adopted by a restarted agent; ERROR -> ERROR: backoff, giving up).
TRANSITIONS: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.CACHING, S.LOADING, S.ERROR, S.UNLOADING, S.STOPPED}),
    S.CACHING: frozenset({S.LOADING, S.ERROR, S.UNLOADING, S.STOPPED, S.PENDING}),
    S.LOADING: frozenset({S.WARMING, S.ERROR, S.UNLOADING, S.STOPPED, S.PENDING}),
    S.WARMING: frozenset({S.READY, S.ERROR, S.UNLOADING, S.STOPPED, S.PENDING}),
    S.READY: frozenset({S.READY, S.ERROR, S.UNLOADING, S.STOPPED}),
    S.UNLOADING: frozenset({S.STOPPED, S.IDLE}),
    S.STOPPED: frozenset({S.PENDING}),
    S.ERROR: frozenset({S.ERROR, S.PENDING, S.UNLOADING, S.STOPPED, S.IDLE}),
    # A cold start (a request, or Start), or an unload of an idle on_demand instance.
    S.IDLE: frozenset({S.PENDING, S.STOPPED}),
}
del S

# Sent after a state change or a progress tick has been committed: (instance, event, progress_only).
instance_changed = Signal()


def name_holders() -> Q:
    """Instances that hold their served name: active ones, IDLE ones, and ones the agent will start again."""
    return Q(state__in=(*ACTIVE_STATES, InstanceState.IDLE)) | (
        Q(desired_state=DesiredState.RUNNING) & Q(state=InstanceState.STOPPED))


class IllegalTransition(Exception):
    """A state change TRANSITIONS does not allow (the row's state changed under the caller)."""

    def __init__(self, instance_id: int, from_state: str, to_state: str) -> None:
        super().__init__(f"instance {instance_id}: {from_state} -> {to_state} is not a legal transition")
        self.from_state = from_state
        self.to_state = to_state


class ModelInstance(models.Model):
    model_name = models.CharField(max_length=255, help_text="served name clients put in `model`")
    aliases = models.JSONField(default=list, blank=True, help_text="more names that route like model_name")
    adapters = models.JSONField(default=list, blank=True, help_text="LoRA adapters loaded with the model: "
                                "[{name, path, scale}], each served as model_name:name (issue 27)")
    replica = models.PositiveSmallIntegerField(
        default=0, help_text="replicas of one served name are numbered 0.. (the lowest free number); its "
                             "ModelDeployment holds how many are wanted")
    model_path = models.CharField(max_length=1024, help_text="store prefix or absolute path on the node")
    artifact = models.ForeignKey("hub.ModelArtifact", null=True, blank=True, on_delete=models.SET_NULL)
    type = models.CharField(max_length=16, choices=InstanceType.choices, default=InstanceType.LLM)
    backend = models.CharField(max_length=64)
    backend_reason = models.TextField(blank=True)
    node = models.ForeignKey("hardware.Node", on_delete=models.PROTECT, related_name="instances")
    gpus = models.JSONField(default=list, blank=True)  # [index, ...] on the node
    tensor_parallel_size = models.IntegerField(default=1)
    extra_args = models.JSONField(default=dict, blank=True)
    preset = models.JSONField(null=True, blank=True, help_text="the engine preset applied at load, as it was then: "
                              "{name, settings} (issue 27 #3); its flags come before extra_args")
    plan = models.JSONField(null=True, blank=True, help_text="the LaunchPlan made when the load was requested")
    autostart = models.BooleanField(
        default=False, help_text="started when its node agent starts (and /readyz waits for it); the rest stay "
                                 "stopped after a clean agent stop")
    # db_default: rows written by code from before on_demand (a rolling upgrade) are `always`.
    policy = models.CharField(max_length=16, choices=Policy.choices, default=Policy.ALWAYS, db_default=Policy.ALWAYS)
    idle_ttl_s = models.PositiveIntegerField(default=0, db_default=0, help_text="on_demand: unloaded after this long without "
                                                                  "a request; 0 = never")
    pinned = models.BooleanField(default=False, db_default=False, help_text="never evicted to make room")
    max_concurrency = models.PositiveIntegerField(null=True, blank=True,
                                                  help_text="requests one replica serves at once; more queue")
    first_byte_timeout_s = models.PositiveIntegerField(
        null=True, blank=True, help_text="the proxy's wait for the first byte of an answer's body (a long "
                                         "prefill); null: XGEN_PROXY_FIRST_BYTE_TIMEOUT")
    last_request_at = models.DateTimeField(null=True, blank=True, help_text="the proxy's last request (batched)")
    drain_until = models.DateTimeField(
        null=True, blank=True, help_text="scaled down: out of routing, stopped once its requests in flight are "
                                         "done or at this time, whichever comes first")
    desired_state = models.CharField(max_length=16, choices=DesiredState.choices, default=DesiredState.RUNNING)
    state = models.CharField(max_length=16, choices=InstanceState.choices, default=InstanceState.PENDING)
    state_message = models.CharField(max_length=500, blank=True)
    progress_pct = models.FloatField(null=True, blank=True)
    port = models.IntegerField(null=True, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    pgid = models.IntegerField(null=True, blank=True)
    # The running backend's secret (a bearer token made at each launch): read by the agent (health,
    # warm-up, adoption) and the proxy's routing table only; never in an API answer, a page or a log.
    backend_key = models.CharField(max_length=128, blank=True, default="", editable=False)
    exit_code = models.IntegerField(null=True, blank=True)
    restarts = models.IntegerField(default=0)
    restart_requested = models.BooleanField(default=False, help_text="an operator asked for a restart")
    last_error = models.TextField(blank=True)
    log_tail = models.JSONField(default=list, blank=True)
    estimated_memory_mib = models.BigIntegerField(null=True, blank=True)
    measured_memory_mib = models.BigIntegerField(null=True, blank=True, help_text="what the backend held once READY")
    measured_source = models.CharField(max_length=16, blank=True, help_text="nvml, amdsmi or rss")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["state", "model_name"])]
        constraints = [
            # Two loads racing for one served name: the database lets one through (an empty
            # SELECT ... FOR UPDATE locks nothing, so only an index can decide).
            models.UniqueConstraint(fields=["model_name", "replica"], condition=name_holders(),
                                    name="serving_one_holder_per_served_name"),
        ]

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
    def on_demand(self) -> bool:
        return self.policy == Policy.ON_DEMAND

    @property
    def idle_unload_at(self):
        """When an on_demand READY instance is unloaded for idleness if no request comes (None: never)."""
        if not self.on_demand or not self.idle_ttl_s or self.state != InstanceState.READY:
            return None
        from datetime import timedelta

        since = max(t for t in (self.last_request_at, self.ready_at, self.created_at) if t is not None)
        return since + timedelta(seconds=self.idle_ttl_s)

    @property
    def idle_text(self) -> str:
        """For the instances list: "idle for 3 min / unloads in 7 min" (READY on_demand), "idle" (IDLE)."""
        if self.state == InstanceState.IDLE:
            return "idle: the next request starts it"
        at = self.idle_unload_at
        if at is None:
            return ""
        now = timezone.now()
        idle_s = max(0.0, self.idle_ttl_s - (at - now).total_seconds())
        left_s = max(0.0, (at - now).total_seconds())
        return f"idle for {_minutes(idle_s)} / unloads in {_minutes(left_s)}"

    @property
    def replicas_desired(self) -> int | None:
        """Its served name's desired replica count (ModelDeployment), read once per object; lists
        set `_replicas_desired` for all their rows with one query."""
        if not hasattr(self, "_replicas_desired"):
            self._replicas_desired = ModelDeployment.objects.filter(model_name=self.model_name) \
                .values_list("replicas", flat=True).first()
        return self._replicas_desired

    @property
    def memory_mib(self) -> int:
        """What the instance holds while it runs (placement, eviction and the API use this one figure):
        the measured figure once the agent recorded one, else the plan's estimate."""
        return int(self.measured_memory_mib or self.estimated_memory_mib or 0)

    @property
    def upstream_base(self) -> str:
        """Where the proxy reaches this backend."""
        return f"http://{self.node.address}:{self.port}"

    # ------------------------------------------------------------ creation
    @classmethod
    def create_requested(cls, *, message: str, announce: bool = True, state: str = InstanceState.PENDING,
                         **fields) -> ModelInstance:
        """A new PENDING (or, on_demand, IDLE) instance and its first timeline row, in one
        transaction; announced after (by the caller, with announce_created(), when the caller's own
        transaction commits later)."""
        with transaction.atomic():
            inst = cls.objects.create(state=state, **fields)
            inst._created_event = InstanceEvent.objects.create(instance=inst, from_state="", to_state=state,
                                                               message=message)
        if announce:
            inst.announce_created()
        return inst

    def announce_created(self) -> None:
        _announce(self, getattr(self, "_created_event", None))

    # ------------------------------------------------------------ state changes
    def _move(self, to_state: str, message: str, *, event: bool = True, clear_process: bool = False,
              only_if_running: bool = False, **fields) -> ModelInstance:
        """Lock the row, check the move against TRANSITIONS, write it and its InstanceEvent in one
        transaction, then announce it. `clear_process`: the backend is gone (pid and group cleared,
        stopped_at set if there was one). `only_if_running`: refused unless desired RUNNING."""
        with transaction.atomic():
            row = type(self).objects.select_for_update(of=("self",)).select_related("node").get(pk=self.pk)
            from_state = row.state
            if to_state not in TRANSITIONS[from_state]:
                raise IllegalTransition(self.pk, from_state, to_state)
            now = timezone.now()
            if clear_process:
                if row.pid:
                    row.stopped_at = now
                row.pid = row.pgid = None
                row.backend_key = ""
                row.progress_pct = None
            row.state = to_state
            row.state_message = message[:500]
            row.updated_at = now
            for name, value in fields.items():
                setattr(row, name, value)
            if only_if_running and row.desired_state != DesiredState.RUNNING:
                raise IllegalTransition(self.pk, from_state, to_state)
            row.save()
            ev = None
            if event:
                ev = InstanceEvent.objects.create(instance=row, from_state=from_state, to_state=to_state,
                                                  message=message)
        self._take(row)
        _announce(self, ev)
        return self

    def _take(self, row: ModelInstance) -> None:
        for f in self._meta.concrete_fields:
            setattr(self, f.attname, getattr(row, f.attname))
        if "node" in row._state.fields_cache:
            self.node = row.node

    def mark_pending(self, reason: str, **fields) -> ModelInstance:
        """Back to PENDING: the agent (re)starts the load. Refused unless the instance should run."""
        return self._move(InstanceState.PENDING, reason, only_if_running=True, progress_pct=None, **fields)

    def mark_caching(self, pct: float = 0.0) -> ModelInstance:
        """The model is being copied from the store into the node cache."""
        return self._move(InstanceState.CACHING, f"copying from the store: {pct:.0f}%", progress_pct=round(pct, 1))

    def set_progress(self, pct: float) -> bool:
        """The copy's progress, written only while the instance is still CACHING (never a state it
        has left); no timeline row. True when the row was updated."""
        return self._note_while(InstanceState.CACHING, f"copying from the store: {pct:.0f}%", pct)

    def set_waiting(self, message: str, pct: float | None) -> bool:
        """What a PENDING start waits for (a llama.cpp build: its percent), written only while the
        instance is still PENDING; no timeline row. True when the row was updated."""
        return self._note_while(InstanceState.PENDING, message, pct)

    def _note_while(self, state: str, message: str, pct: float | None) -> bool:
        """Message and progress written only while the row is still in `state`, announced as a
        progress tick (no timeline row); True when the row was updated."""
        now = timezone.now()
        pct = None if pct is None else round(pct, 1)
        message = message[:500]
        updated = type(self).objects.filter(pk=self.pk, state=state).update(
            progress_pct=pct, state_message=message, updated_at=now)
        if not updated:
            return False
        self.state, self.progress_pct, self.state_message, self.updated_at = state, pct, message, now
        _announce(self, None, progress_only=True)
        return True

    def mark_loading(self, *, pid: int, pgid: int, port: int, gpus: list[int], message: str,
                     backend_key: str = "") -> ModelInstance:
        """The backend process runs (pid, its group, its port, the GPUs it holds, the secret it
        requires); the model loads."""
        return self._move(InstanceState.LOADING, message, pid=pid, pgid=pgid, port=port, gpus=list(gpus),
                          backend_key=backend_key,
                          started_at=timezone.now(), exit_code=None, progress_pct=None, log_tail=[], ready_at=None)

    def mark_warming(self) -> ModelInstance:
        return self._move(InstanceState.WARMING, "sending one warm-up request")

    def mark_ready(self, message: str, *, adopted: bool = False) -> ModelInstance:
        """Health and warm-up passed (or a restarted agent adopted the healthy backend)."""
        return self._move(InstanceState.READY, message, **({} if adopted else {"ready_at": timezone.now()}))

    def mark_error(self, message: str, *, last_error: str | None = None, event: bool = True,
                   **process) -> ModelInstance:
        """Failed; its process is gone. `process` may carry exit_code and log_tail."""
        if last_error is not None:
            process["last_error"] = last_error
        return self._move(InstanceState.ERROR, message, event=event, clear_process=True, **process)

    def mark_unloading(self, reason: str) -> ModelInstance:
        """The backend is being stopped."""
        return self._move(InstanceState.UNLOADING, reason)

    def mark_stopped(self, reason: str, *, keep_gpus: bool = False, **process) -> ModelInstance:
        """No process any more: pid, group and port are free, and the GPUs unless it starts again on
        them. `process` may carry the exit_code."""
        fields = {"port": None, "stopped_at": timezone.now(), **process}
        if not keep_gpus:
            fields["gpus"] = []
        return self._move(InstanceState.STOPPED, reason, clear_process=True, **fields)

    def mark_idle(self, reason: str, **process) -> ModelInstance:
        """on_demand, no process: pid, port and GPUs free; the next request starts it again."""
        return self._move(InstanceState.IDLE, reason, clear_process=True, port=None, gpus=[],
                          stopped_at=timezone.now(), progress_pct=None, **process)

    # ------------------------------------------------------------ requests that are no state change
    def note_restart_requested(self) -> ModelInstance:
        """A restart of a live instance: desired RUNNING, the agent restarts it; a timeline row says so."""
        with transaction.atomic():
            row = type(self).objects.select_for_update(of=("self",)).select_related("node").get(pk=self.pk)
            row.desired_state = DesiredState.RUNNING
            row.restart_requested = True
            row.updated_at = timezone.now()
            row.save(update_fields=["desired_state", "restart_requested", "updated_at"])
            ev = InstanceEvent.objects.create(instance=row, from_state=row.state, to_state=row.state,
                                              message="restart requested")
        self._take(row)
        _announce(self, ev)
        return self

    def note(self, message: str) -> None:
        """A timeline row that is no state change (a measurement, a leak found after a stop)."""
        ev = InstanceEvent.objects.create(instance=self, from_state=self.state, to_state=self.state,
                                          message=message[:2000])
        _announce(self, ev)

    def forget_process(self) -> None:
        """A pid recorded on a row that is no longer active (its backend is gone): clear it."""
        type(self).objects.filter(pk=self.pk).update(pid=None, pgid=None, backend_key="")
        self.pid = self.pgid = None
        self.backend_key = ""


def _minutes(seconds: float) -> str:
    return f"{int(seconds)} s" if seconds < 90 else f"{round(seconds / 60)} min"


def _announce(instance: ModelInstance, event: InstanceEvent | None, *, progress_only: bool = False) -> None:
    try:
        instance_changed.send(sender=ModelInstance, instance=instance, event=event, progress_only=progress_only)
    except Exception:  # a live update must never break a state change
        log.warning("live update for %s failed", instance, exc_info=True)


class ModelDeployment(models.Model):
    """One served name's desired replica count (issue 30), stored once whatever its instances: the
    instances holding the name (ModelInstance.model_name, numbered by `replica`) are its replicas.
    The served name is the key the instances already share (and the unique constraint on
    (model_name, replica) is held on), so the row owns them by name, not by a foreign key."""

    model_name = models.CharField(max_length=255, unique=True)
    replicas = models.PositiveSmallIntegerField(default=1, help_text="replicas wanted; 0 once unloaded")
    drain_timeout_s = models.PositiveIntegerField(
        default=30, help_text="a replica scaled down waits at most this long for its requests in flight")
    # Autoscaling (issue 30 #2): on while target_in_flight is set (serving.control.autoscale).
    min_replicas = models.PositiveSmallIntegerField(default=1, help_text="the autoscaler's floor (0: the last "
                                                                        "replica is left to on_demand's idle unload)")
    max_replicas = models.PositiveSmallIntegerField(default=1, help_text="the autoscaler's ceiling")
    target_in_flight = models.FloatField(null=True, blank=True, help_text="requests in flight (and queued) per "
                                                                          "replica the autoscaler aims at; null: off")
    scale_up_window_s = models.PositiveIntegerField(default=30, help_text="load must stay above the target this "
                                                                          "long before a replica is added")
    scale_down_delay_s = models.PositiveIntegerField(default=600, help_text="load must stay below the target this "
                                                                            "long before a replica is removed")
    last_scaled_at = models.DateTimeField(null=True, blank=True, help_text="the last change of `replicas`")
    rollout = models.JSONField(null=True, blank=True, help_text="a rolling restart under way: the new extra_args, "
                                                                 "the replicas still to restart, the drain timeout")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.model_name} x{self.replicas}"

    @property
    def autoscaling(self) -> bool:
        return self.target_in_flight is not None and self.target_in_flight > 0


class EnginePreset(models.Model):
    """A model's named engine settings (issue 27 #3), chosen in the Load dialog or by the load's
    `preset`; portable fields that each engine gets as its own flags (serving.control.presets),
    held against the engine version's flags at save (every version the nodes report) and at load.
    One preset of a model may be its default: a load that names none gets it."""

    model_path = models.CharField(max_length=1024, help_text="the store prefix or absolute path it is for")
    name = models.CharField(max_length=64)
    engine_settings = models.JSONField(default=dict, help_text="serving.control.presets.FIELDS")
    is_default = models.BooleanField(default=False, help_text="applied to a load of the model that names none")
    updated_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["model_path", "name"]
        constraints = [
            models.UniqueConstraint(fields=["model_path", "name"], name="one_preset_name_per_model"),
            models.UniqueConstraint(fields=["model_path"], condition=models.Q(is_default=True),
                                    name="one_default_preset_per_model"),
        ]

    def __str__(self) -> str:
        return f"{self.model_path}: {self.name}"


class ScalingDecision(models.Model):
    """One change of a model's replica count by the autoscaler: when, from, to, and why (the load
    it saw and the window it held for); shown on the model's page and in the audit log."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    model_name = models.CharField(max_length=255)
    from_replicas = models.PositiveSmallIntegerField()
    to_replicas = models.PositiveSmallIntegerField()
    reason = models.TextField()

    class Meta:
        ordering = ["-at", "-pk"]
        indexes = [models.Index(fields=["model_name", "at"])]


class InFlightReport(models.Model):
    """A web process's requests in flight and queued for a model, written each ACTIVITY_FLUSH_S while
    it has some (and once at 0): what the autoscaler sums over the fleet (fresh rows only)."""

    process = models.CharField(max_length=200, help_text="host:pid of the web process")
    model_name = models.CharField(max_length=255)
    in_flight = models.PositiveIntegerField(default=0)
    queued = models.PositiveIntegerField(default=0)
    instances = models.JSONField(default=dict, help_text="requests in flight per instance id (its replicas)")
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["process", "model_name"], name="one_report_per_process_model")]


class ControllerLease(models.Model):
    """Who runs a cluster-wide loop (the autoscaler): one web process holds the row until
    `expires_at`, renewing it; another takes it over once it expired (a conditional UPDATE)."""

    name = models.CharField(max_length=64, unique=True)
    holder = models.CharField(max_length=200)
    expires_at = models.DateTimeField()


class InstanceEvent(models.Model):
    """One state transition of an instance; the timeline on its page."""

    instance = models.ForeignKey(ModelInstance, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(default=timezone.now)
    from_state = models.CharField(max_length=16, blank=True)
    to_state = models.CharField(max_length=16)
    message = models.TextField(blank=True)

    class Meta:
        ordering = ["at", "pk"]
        indexes = [  # the timeline and chargeback's "state when the range began" (per instance), and
            # the chargeback's events in a range: scans of the whole table before (bench/pages.py /usage/)
            models.Index(fields=["instance", "at"], name="instanceevent_instance_at"),
            models.Index(fields=["at"], name="instanceevent_at"),
        ]


class MemoryMeasurement(models.Model):
    """What a model really held on a backend, by what changes it (artifact, backend, context size,
    tensor parallel size): the next Load dialog and placement use it instead of the estimate."""

    model_path = models.CharField(max_length=1024)
    backend = models.CharField(max_length=48, help_text="backend and flavour: 'llama-server (cuda)'")
    ctx = models.IntegerField(default=0, help_text="the context size asked for; 0: the backend's default")
    tensor_parallel_size = models.IntegerField(default=1)
    measured_mib = models.BigIntegerField()
    source = models.CharField(max_length=16)
    node_name = models.CharField(max_length=100)
    measured_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["model_path", "backend", "ctx", "tensor_parallel_size"],
                                               name="one_measurement_per_load_shape")]


class UsageBucket(models.Model):
    """Inference usage in one hour, per key, user, model, instance and node; summed by every web
    process (serving.proxy.usage writes them in batches). Names are kept as they were (the rows outlive
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
    # The team that owned the key when the requests were made (a key moved to another team takes
    # none of its past usage along): team usage, quotas, GPU-seconds and chargeback read these.
    team_id = models.IntegerField(default=0, help_text="0: the key had no team")
    team_slug = models.CharField(max_length=50, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(
            fields=["bucket_start", "key_id", "username", "model", "instance_id", "node", "team_id"],
            name="usage_bucket_unique_team")]
        indexes = [models.Index(fields=["key_id", "bucket_start"]), models.Index(fields=["bucket_start"]),
                   models.Index(fields=["team_id", "bucket_start"])]


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
    client_request_id = models.CharField(max_length=128, blank=True, db_index=True,
                                         help_text="the caller's X-Request-ID; request_id is the console's own")
    usage_source = models.CharField(
        max_length=8, default="engine",
        help_text="who counted the tokens: engine (its own usage), console (the engine's prompt count, "
                  "the events streamed)")
    team_id = models.IntegerField(default=0, help_text="the team that owned the key then; 0: none")
    team_slug = models.CharField(max_length=50, blank=True)
    resumes = models.PositiveSmallIntegerField(  # db_default: a web process of the version before inserts without it
        default=0, db_default=0, help_text="times the stream went on on another replica after its own broke (XGEN_STREAM_RESUME_MAX)")

    class Meta:
        ordering = ["-at", "-pk"]
        indexes = [models.Index(fields=["key_id", "at"]), models.Index(fields=["model", "at"]),
                   models.Index(fields=["team_id", "at"])]


class UsageJournalSegment(models.Model):
    """A usage-journal segment whose rows are in the request log and usage buckets (serving.proxy.usage_journal):
    written in the same transaction as they are, so a segment replayed after its owner died between
    that commit and deleting the file is never counted twice. Pruned after XGEN_REQUEST_LOG_DAYS + 1."""

    name = models.CharField(max_length=100, unique=True)
    committed_at = models.DateTimeField(auto_now_add=True, db_index=True)
