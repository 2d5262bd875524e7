from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('serving', '0007_usage_and_request_log'),
    ]

    operations = [
        migrations.AlterField(
            model_name='modelinstance',
            name='type',
            field=models.CharField(choices=[('llm', 'Llm'), ('embedding', 'Embedding'), ('rerank', 'Rerank')],
                                   default='llm', max_length=16),
        ),
    ]
