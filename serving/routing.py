from django.urls import path

from serving.consumers import InstanceConsumer, InstancesConsumer

websocket_urlpatterns = [
    path("ws/instances/", InstancesConsumer.as_asgi()),
    path("ws/instances/<int:pk>/", InstanceConsumer.as_asgi()),
]
