from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "accounts"
    verbose_name = "Accounts"

    def ready(self) -> None:
        from accounts import signals, signin

        signals.connect()
        signin.connect()

        from django.conf import settings
        from django.core.exceptions import ImproperlyConfigured

        from accounts.sso import MappingError, parse_group_roles, parse_group_teams

        try:  # a wrong mapping stops the start, not the first sign-in
            parse_group_roles(settings.SSO_GROUP_ROLES)
            parse_group_teams(settings.SSO_GROUP_TEAMS)
        except MappingError as exc:
            raise ImproperlyConfigured(str(exc)) from None

        from django.contrib.auth.signals import user_logged_out
        from django.db.models.signals import post_save

        from accounts.models import User
        from live.publish import user_changed_sync

        def signed_out(sender, user=None, **kwargs) -> None:
            if user is not None:
                user_changed_sync(user.pk)

        def saved(sender, instance: User, created: bool, **kwargs) -> None:
            if not created:  # deactivated, another role, a new password: open live pages check again
                user_changed_sync(instance.pk)

        user_logged_out.connect(signed_out, weak=False, dispatch_uid="xgen-live-signed-out")
        post_save.connect(saved, sender=User, weak=False, dispatch_uid="xgen-live-user-saved")
