from django.core.management.base import BaseCommand, CommandError

from accounts.models import User
from accounts.services import create_api_key


class Command(BaseCommand):
    help = "Create an API key for a user and print it once (only its hash is stored)."

    def add_arguments(self, parser):
        parser.add_argument("--username", required=True)
        parser.add_argument("--name", default="cli")

    def handle(self, *args, username: str, name: str, **options):
        user = User.objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user {username!r}")
        _, raw = create_api_key(user=user, name=name)
        self.stdout.write(raw)
