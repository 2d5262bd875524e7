from django.urls import path

from hub.consumers import DownloadsConsumer, NodeCacheConsumer, UploadsConsumer

websocket_urlpatterns = [
    path("ws/downloads/", DownloadsConsumer.as_asgi()),
    path("ws/uploads/", UploadsConsumer.as_asgi()),
    path("ws/nodes/<str:name>/cache/", NodeCacheConsumer.as_asgi()),
]
