from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("serving", "0011_event_indexes"),
    ]

    operations = [
        migrations.AddField(
            model_name="modelinstance",
            name="first_byte_timeout_s",
            field=models.PositiveIntegerField(
                blank=True, help_text="the proxy's wait for the first byte of an answer's body (a long prefill); "
                                      "null: XGEN_PROXY_FIRST_BYTE_TIMEOUT", null=True),
        ),
    ]
