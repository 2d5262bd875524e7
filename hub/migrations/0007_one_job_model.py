"""Upload, download and cache jobs become one table (hub.Job, with a kind); the rows move over.

Every job keeps its id as its `number` (the id the API, the pages and the write locks name): a
download keeps its primary key too; upload and cache jobs get primary keys above every old id,
and the sequence is moved past them, so every job made from here on has number == primary key.
"""
import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.core.management.color import no_style
from django.db import migrations, models

COMMON = ("status", "bytes_done", "bytes_total", "error", "cancel_requested", "created_by_id", "created_at",
          "started_at", "finished_at")
KINDS = {  # kind: (old model, its own fields, as old name -> new name)
    "download": ("DownloadJob", {"repo_id": "repo_id", "revision": "revision", "format": "format",
                                 "allow_patterns": "allow_patterns", "files": "files", "target_prefix": "target_prefix",
                                 "node": "node", "replace": "replace", "pid": "pid", "pgid": "pgid"}),
    "upload": ("UploadJob", {"local_path": "local_path", "format": "format", "target_prefix": "target_prefix",
                             "replace": "replace", "node": "node"}),
    "cache": ("CacheJob", {"node": "node", "prefix": "target_prefix", "action": "action", "result": "result"}),
}
NOT_IN_CACHE_JOBS = ("bytes_done", "bytes_total", "cancel_requested", "started_at")


def _reset_sequence(schema_editor, model) -> None:
    for sql in schema_editor.connection.ops.sequence_reset_sql(no_style(), [model]):
        schema_editor.execute(sql)


def merge_jobs(apps, schema_editor):
    Job = apps.get_model("hub", "Job")
    old = {kind: apps.get_model("hub", name) for kind, (name, _fields) in KINDS.items()}
    top = max([0] + [m.objects.aggregate(top=models.Max("pk"))["top"] or 0 for m in old.values()])
    next_pk = top + 1
    for kind, (_name, fields) in KINDS.items():
        common = [f for f in COMMON if not (kind == "cache" and f in NOT_IN_CACHE_JOBS)]
        rows = []
        for row in old[kind].objects.order_by("pk").iterator():
            values = {f: getattr(row, f) for f in common}
            values.update({new: getattr(row, old_name) for old_name, new in fields.items()})
            if kind == "download":
                pk = row.pk
            else:
                pk, next_pk = next_pk, next_pk + 1
            rows.append(Job(pk=pk, kind=kind, number=row.pk, **values))
        Job.objects.bulk_create(rows, batch_size=500)
    _reset_sequence(schema_editor, Job)


def split_jobs(apps, schema_editor):
    Job = apps.get_model("hub", "Job")
    for kind, (name, fields) in KINDS.items():
        model = apps.get_model("hub", name)
        common = [f for f in COMMON if not (kind == "cache" and f in NOT_IN_CACHE_JOBS)]
        rows = []
        for job in Job.objects.filter(kind=kind).order_by("pk").iterator():
            values = {f: getattr(job, f) for f in common}
            values.update({old_name: getattr(job, new) for old_name, new in fields.items()})
            rows.append(model(pk=job.number, **values))
        model.objects.bulk_create(rows, batch_size=500)
        _reset_sequence(schema_editor, model)


class Migration(migrations.Migration):

    dependencies = [
        ("hub", "0006_download_replace_and_child"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="Job",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("kind", models.CharField(choices=[("upload", "Upload"), ("download", "Download"), ("cache", "Cache")],
                                          max_length=16)),
                ("number", models.IntegerField(blank=True, help_text="the id of the job in its kind's API", null=True)),
                ("status", models.CharField(choices=[("PENDING", "Pending"), ("RUNNING", "Running"),
                                                     ("DOWNLOADING", "Downloading"), ("UPLOADING", "Uploading"),
                                                     ("COMPLETED", "Completed"), ("FAILED", "Failed"),
                                                     ("CANCELLED", "Cancelled")], default="PENDING", max_length=16)),
                ("node", models.CharField(blank=True, help_text="the node whose agent runs (or claimed) the job",
                                          max_length=100)),
                ("target_prefix", models.CharField(blank=True, help_text="the model the job writes or checks",
                                                   max_length=512)),
                ("format", models.CharField(blank=True, choices=[("gguf", "Gguf"), ("huggingface", "Huggingface")],
                                            max_length=16)),
                ("replace", models.BooleanField(default=False, help_text="may overwrite a complete model")),
                ("bytes_done", models.BigIntegerField(default=0)),
                ("bytes_total", models.BigIntegerField(default=0)),
                ("error", models.TextField(blank=True)),
                ("cancel_requested", models.BooleanField(default=False)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("started_at", models.DateTimeField(blank=True, null=True)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                ("repo_id", models.CharField(blank=True, max_length=255)),
                ("revision", models.CharField(blank=True, max_length=128)),
                ("allow_patterns", models.JSONField(blank=True, default=list)),
                ("files", models.JSONField(blank=True, default=list)),
                ("pid", models.IntegerField(blank=True, help_text="the download child process, while it runs",
                                            null=True)),
                ("pgid", models.IntegerField(blank=True, help_text="its process group (stopped as a whole)",
                                             null=True)),
                ("local_path", models.CharField(blank=True, max_length=4096)),
                ("action", models.CharField(blank=True, max_length=16)),
                ("result", models.JSONField(blank=True, default=dict)),
                ("created_by", models.ForeignKey(blank=True, null=True,
                                                 on_delete=django.db.models.deletion.SET_NULL,
                                                 to=settings.AUTH_USER_MODEL)),
            ],
            options={
                "ordering": ["-created_at", "-pk"],
                "indexes": [models.Index(fields=["kind", "status", "node"], name="hub_job_kind_status_node")],
                "constraints": [models.UniqueConstraint(fields=("kind", "number"), name="hub_job_uniq_kind_number")],
            },
        ),
        migrations.RunPython(merge_jobs, split_jobs),
        migrations.DeleteModel(name="CacheJob"),
        migrations.DeleteModel(name="DownloadJob"),
        migrations.DeleteModel(name="UploadJob"),
        migrations.CreateModel(name="CacheJob", fields=[], options={"proxy": True, "indexes": [], "constraints": []},
                               bases=("hub.job",)),
        migrations.CreateModel(name="DownloadJob", fields=[],
                               options={"proxy": True, "indexes": [], "constraints": []}, bases=("hub.job",)),
        migrations.CreateModel(name="UploadJob", fields=[],
                               options={"proxy": True, "indexes": [], "constraints": []}, bases=("hub.job",)),
    ]
