from django.db import migrations


# User and ApiKey live in accounts now, on the same tables (accounts 0001): Django forgets them
# here without touching the database, once nothing in the state points at them any more.
class Migration(migrations.Migration):

    dependencies = [
        ('xgenconsole', '0001_initial'),
        ('accounts', '0001_initial'),
        ('hub', '0003_user_in_accounts'),
        ('serving', '0004_user_in_accounts'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.DeleteModel(name='ApiKey'),
                migrations.DeleteModel(name='User'),
            ],
        ),
    ]
