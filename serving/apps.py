from django.apps import AppConfig


class ServingConfig(AppConfig):
    name = "serving"

    def ready(self) -> None:
        from hardware.allocation import set_holder_source, set_visibility_source
        from hub.node_cache import set_users_source
        from serving.control.allocation import active_holders, cache_users
        from serving.web.team_views import lead_visible_instances

        set_holder_source(active_holders)  # hardware shows who holds each GPU without importing serving
        set_visibility_source(lead_visible_instances)  # ...and a team lead only its teams' GPUs
        set_users_source(cache_users)  # the hub never evicts a cached model an instance uses
        import serving.control.events  # noqa: F401  (connects the routing push on instance state changes)
        import serving.web.live  # noqa: F401  (connects the live page updates of instance state changes)
        from serving.proxy.usage import recorder
        from serving.web.dashboard import publish_models

        if publish_models not in recorder.after_write:
            recorder.after_write.append(publish_models)  # open dashboards get the model charts after each flush
