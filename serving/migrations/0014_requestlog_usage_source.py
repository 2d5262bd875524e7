from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("serving", "0013_instance_backend_key"),
    ]

    operations = [
        migrations.AddField(
            model_name="requestlog",
            name="usage_source",
            field=models.CharField(
                default="engine", max_length=8,
                help_text="who counted the tokens: engine (its own usage), console (the engine's prompt count, "
                          "the events streamed)"),
        ),
    ]
