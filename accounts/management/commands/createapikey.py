from django.core.management.base import BaseCommand, CommandError

from accounts.audit import record_audit
from accounts.models import Team, User
from accounts.services import KeyInputError, create_api_key, expiry_in, priority_value


def _models(value: str) -> list[str]:
    return [m.strip() for m in value.split(",") if m.strip()]


class Command(BaseCommand):
    help = ("Create an API key for a user and print it once (only its hash is stored). "
            "Limits left out are unlimited.")
    # Django's system checks import every URLconf and the whole API (1.4 of 2.3 s a call): an
    # account command needs none of it; `manage.py check` and the server's start still run them.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser):
        parser.add_argument("--username", required=True)
        parser.add_argument("--name", default="cli")
        parser.add_argument("--expires-in-days", type=int)
        parser.add_argument("--allowed-models", type=_models, default=None,
                            help="comma-separated served model names (default: every model)")
        parser.add_argument("--rpm", type=int, help="requests per minute")
        parser.add_argument("--tpm", type=int, help="tokens per minute")
        parser.add_argument("--daily-tokens", type=int, help="tokens per UTC day")
        parser.add_argument("--monthly-tokens", type=int, help="tokens per UTC month")
        parser.add_argument("--scopes", type=_models, default=None,
                            help="comma-separated, of inference, read, manage (default: all three)")
        parser.add_argument("--team", help="the slug of the team that owns the key (its limits apply too)")
        parser.add_argument("--priority", type=priority_value,
                            help="high, normal (default) or low, or 0-9; higher goes first when requests queue")

    def handle(self, *args, username: str, name: str, **options):
        user = User.objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user {username!r}")
        limits = {f: options[f] for f in ("allowed_models", "rpm", "tpm", "daily_tokens", "monthly_tokens",
                                          "priority", "scopes") if options.get(f) is not None}
        team = None
        if options.get("team"):
            team = Team.objects.filter(slug=options["team"]).first()
            if team is None:
                raise CommandError(f"no team {options['team']!r}")
        try:
            key, raw = create_api_key(user=user, name=name, expires_at=expiry_in(options.get("expires_in_days")),
                                      team=team, **limits)
        except KeyInputError as exc:
            raise CommandError(str(exc)) from None
        record_audit(action="key_create", actor="cli", target=f"key {key.pk} ({key.name})",
                     detail={"user": user.username, "via": "cli", "team": team.slug if team else None, **limits})
        self.stdout.write(raw)
