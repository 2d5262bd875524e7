from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('hardware', '0003_inventory_run'),
    ]

    operations = [
        migrations.AddField(
            model_name='node',
            name='agent_id',
            field=models.CharField(blank=True, db_default='', default='', help_text="the id of the agent process holding the node ('': none)", max_length=32),
        ),
        migrations.AddField(
            model_name='node',
            name='agent_host',
            field=models.CharField(blank=True, db_default='', default='', help_text="the holding agent's host: hostname#boot id", max_length=300),
        ),
    ]
