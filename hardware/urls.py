from django.urls import path

from hardware import views

urlpatterns = [
    path("gpus/", views.gpus_page, name="gpus"),
    path("nodes/<str:name>/", views.node_detail, name="node-detail"),
]
