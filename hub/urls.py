from django.urls import path

from hub import views

urlpatterns = [
    path("models/", views.models_page, name="models"),
    path("downloads/", views.downloads_page, name="downloads"),
]
