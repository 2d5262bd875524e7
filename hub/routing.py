from django.urls import path

from hub.consumers import DownloadsConsumer

websocket_urlpatterns = [
    path("ws/downloads/", DownloadsConsumer.as_asgi()),
]
