from django.urls import path

from serving.web.consumers import DashboardConsumer, InstanceConsumer, InstancesConsumer

websocket_urlpatterns = [
    path("ws/instances/", InstancesConsumer.as_asgi()),
    path("ws/instances/<int:pk>/", InstanceConsumer.as_asgi()),
    path("ws/dashboard/<str:range>/", DashboardConsumer.as_asgi()),
]
