from django.apps import AppConfig


class ServingConfig(AppConfig):
    name = "serving"

    def ready(self) -> None:
        from hardware.allocation import set_holder_source
        from serving.allocation import active_holders

        set_holder_source(active_holders)  # hardware shows who holds each GPU without importing serving
        import serving.events  # noqa: F401  (connects the live updates of instance state changes)
