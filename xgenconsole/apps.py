from django.apps import AppConfig


class XgenConsoleConfig(AppConfig):
    name = "xgenconsole"
    verbose_name = "XGEN Console"
