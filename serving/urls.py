from django.urls import path

from serving import views

urlpatterns = [
    path("instances/", views.instances_page, name="instances"),
    path("instances/<int:pk>/", views.instance_detail, name="instance-detail"),
]
