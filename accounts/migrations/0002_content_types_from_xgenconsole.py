from django.db import migrations

MODELS = ("user", "apikey")


def _relabel(apps, schema_editor, old: str, new: str) -> None:
    ContentType = apps.get_model("contenttypes", "ContentType")
    db = schema_editor.connection.alias
    for model in MODELS:
        if not ContentType.objects.using(db).filter(app_label=new, model=model).exists():
            ContentType.objects.using(db).filter(app_label=old, model=model).update(app_label=new)


def forwards(apps, schema_editor) -> None:
    _relabel(apps, schema_editor, "xgenconsole", "accounts")


def backwards(apps, schema_editor) -> None:
    _relabel(apps, schema_editor, "accounts", "xgenconsole")


# The content types of a 0.1.0 database (xgenconsole.user, xgenconsole.apikey) become accounts'
# own, so the permissions attached to them (and granted to users and groups) stay attached.
# A fresh database has none yet: Django creates accounts' after migrating.
class Migration(migrations.Migration):

    dependencies = [
        ("accounts", "0001_initial"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [
        migrations.RunPython(forwards, backwards),
    ]
