"""Usage and the request log name the team that owned the key when the request was made (a key moved
to another team takes none of its past usage along). Rows written before this name the team that
owns their key at the upgrade: the best the console knew then (it read the key's current team)."""

from django.db import migrations, models


def backfill(apps, schema_editor):
    ApiKey = apps.get_model("accounts", "ApiKey")
    Team = apps.get_model("accounts", "Team")
    UsageBucket = apps.get_model("serving", "UsageBucket")
    RequestLog = apps.get_model("serving", "RequestLog")
    for team_id, slug in Team.objects.values_list("pk", "slug"):
        keys = list(ApiKey.objects.filter(team_id=team_id).values_list("pk", flat=True))
        for start in range(0, len(keys), 500):
            chunk = keys[start:start + 500]
            UsageBucket.objects.filter(key_id__in=chunk).update(team_id=team_id, team_slug=slug)
            RequestLog.objects.filter(key_id__in=chunk).update(team_id=team_id, team_slug=slug)


class Migration(migrations.Migration):

    dependencies = [
        ('serving', '0020_adapters'),
        ('accounts', '0008_team_gpu_budget_enforced'),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name='usagebucket',
            name='usage_bucket_unique',
        ),
        migrations.AddField(
            model_name='requestlog',
            name='team_id',
            field=models.IntegerField(default=0, help_text='the team that owned the key then; 0: none'),
        ),
        migrations.AddField(
            model_name='requestlog',
            name='team_slug',
            field=models.CharField(blank=True, max_length=50),
        ),
        migrations.AddField(
            model_name='usagebucket',
            name='team_id',
            field=models.IntegerField(default=0, help_text='0: the key had no team'),
        ),
        migrations.AddField(
            model_name='usagebucket',
            name='team_slug',
            field=models.CharField(blank=True, max_length=50),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
        migrations.AddIndex(
            model_name='requestlog',
            index=models.Index(fields=['team_id', 'at'], name='serving_req_team_id_04a9b6_idx'),
        ),
        migrations.AddIndex(
            model_name='usagebucket',
            index=models.Index(fields=['team_id', 'bucket_start'], name='serving_usa_team_id_98fbfc_idx'),
        ),
        migrations.AddConstraint(
            model_name='usagebucket',
            constraint=models.UniqueConstraint(fields=('bucket_start', 'key_id', 'username', 'model', 'instance_id', 'node', 'team_id'), name='usage_bucket_unique_team'),
        ),
    ]
