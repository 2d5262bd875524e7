from django.urls import path

from hardware.consumers import GpusConsumer

websocket_urlpatterns = [
    path("ws/gpus/", GpusConsumer.as_asgi()),
]
