import os
import secrets

from django.core.management.base import BaseCommand

from accounts.models import Role, User
from accounts.services import create_user


class Command(BaseCommand):
    help = "Create the first admin if no admin exists (password from XGEN_ADMIN_PASSWORD, else printed once)."
    # Django's system checks import every URLconf and the whole API (1.4 of 2.3 s a call): an
    # account command needs none of it; `manage.py check` and the server's start still run them.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser):
        parser.add_argument("--username", default=os.environ.get("XGEN_ADMIN_USER", "admin"))

    def handle(self, *args, username: str, **options):
        if User.objects.filter(role=Role.ADMIN).exists() or User.objects.filter(is_superuser=True).exists():
            self.stdout.write("an admin exists; nothing to do")
            return
        password = os.environ.get("XGEN_ADMIN_PASSWORD") or ""
        generated = not password
        if generated:
            password = secrets.token_urlsafe(12)
        create_user(username=username, role=Role.ADMIN, password=password)
        if generated:
            self.stdout.write(f"created admin {username!r} with password: {password}\n(shown once; change it on the Users page)")
        else:
            self.stdout.write(f"created admin {username!r} with the password from XGEN_ADMIN_PASSWORD")
