import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


# created_by now points at accounts.User: the same table (xgenconsole_user), so the database's
# column and foreign key stay as they are and only Django's state changes.
class Migration(migrations.Migration):

    dependencies = [
        ('hub', '0002_initial'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.AlterField(
                    model_name='downloadjob',
                    name='created_by',
                    field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL,
                                            to=settings.AUTH_USER_MODEL),
                ),
            ],
        ),
    ]
