import logging

from django.apps import AppConfig


class XgenConsoleConfig(AppConfig):
    name = "xgenconsole"
    verbose_name = "XGEN Console"

    def ready(self) -> None:
        from xgenconsole.views import DatabaseAwayTracebacks

        logging.getLogger("django.request").addFilter(DatabaseAwayTracebacks())
