from django.apps import AppConfig


class HubConfig(AppConfig):
    name = "hub"

    def ready(self) -> None:
        import hub.node_cache  # noqa: F401  (registers the XGEN_CACHE_MAX_GB room keeper with hub.cache)
