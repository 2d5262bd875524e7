from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("serving", "0012_instance_first_byte_timeout"),
    ]

    operations = [
        migrations.AddField(
            model_name="modelinstance",
            name="backend_key",
            field=models.CharField(blank=True, default="", editable=False, max_length=128),
        ),
    ]
