import getpass

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from accounts.audit import record_audit
from accounts.models import Role, User
from accounts.services import create_user


class Command(BaseCommand):
    help = "Create a console user with a role (admin, operator, viewer)."
    # Django's system checks import every URLconf and the whole API (1.4 of 2.3 s a call): an
    # account command needs none of it; `manage.py check` and the server's start still run them.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser):
        parser.add_argument("--username", required=True)
        parser.add_argument("--role", required=True, choices=Role.values)
        parser.add_argument("--password", help="prompted when omitted")
        parser.add_argument("--email", default="")

    def handle(self, *args, username: str, role: str, password: str | None, email: str, **options):
        if User.objects.filter(username__iexact=username).exists():
            raise CommandError(f"user {username!r} exists")
        if password is None:
            password = getpass.getpass("Password: ")
            if password != getpass.getpass("Password (again): "):
                raise CommandError("passwords do not match")
        from django.contrib.auth.password_validation import validate_password

        try:
            validate_password(password, user=User(username=username, email=email))
        except ValidationError as exc:
            raise CommandError("; ".join(exc.messages)) from None
        user = create_user(username=username, role=role, password=password, email=email)
        record_audit(action="user_create", actor="cli", target=user.username, detail={"role": user.role, "via": "cli"})
        self.stdout.write(f"created user {user.username} ({user.role})")
