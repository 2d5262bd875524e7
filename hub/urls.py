from django.urls import path

from hub import views

urlpatterns = [
    path("models/", views.models_page, name="models"),
    path("models/upload/", views.upload_page, name="model-upload"),
    path("models/uploads/<int:pk>/cancel/", views.upload_cancel, name="upload-cancel"),
    path("models/delete/", views.model_delete, name="model-delete"),
    path("models/refresh/", views.models_refresh, name="models-refresh"),
    path("downloads/", views.downloads_page, name="downloads"),
    path("downloads/<int:pk>/cancel/", views.download_cancel, name="download-cancel"),
]
