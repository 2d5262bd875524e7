from django.apps import AppConfig


class ServingConfig(AppConfig):
    name = "serving"

    def ready(self) -> None:
        from hardware.allocation import set_holder_source
        from hub.node_cache import set_users_source
        from serving.allocation import active_holders, cache_users

        set_holder_source(active_holders)  # hardware shows who holds each GPU without importing serving
        set_users_source(cache_users)  # the hub never evicts a cached model an instance uses
        import serving.events  # noqa: F401  (connects the live updates of instance state changes)
        from serving.dashboard import publish_models
        from serving.usage import recorder

        if publish_models not in recorder.after_write:
            recorder.after_write.append(publish_models)  # open dashboards get the model charts after each flush
