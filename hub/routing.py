from django.urls import path

from hub.consumers import DownloadsConsumer, UploadsConsumer

websocket_urlpatterns = [
    path("ws/downloads/", DownloadsConsumer.as_asgi()),
    path("ws/uploads/", UploadsConsumer.as_asgi()),
]
