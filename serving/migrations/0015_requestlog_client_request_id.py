from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("serving", "0014_requestlog_usage_source"),
    ]

    operations = [
        migrations.AddField(
            model_name="requestlog",
            name="client_request_id",
            field=models.CharField(blank=True, db_index=True, max_length=128,
                                   help_text="the caller's X-Request-ID; request_id is the console's own"),
        ),
    ]
