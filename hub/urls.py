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
    # A node's cache card: the hub owns caches; the node page (hardware) fetches it by URL.
    path("nodes/<str:name>/cache/", views.node_cache_card, name="node-cache"),
    path("nodes/<str:name>/cache/evict/", views.node_cache_action, {"action": "evict"}, name="node-cache-evict"),
    path("nodes/<str:name>/cache/verify/", views.node_cache_action, {"action": "verify"}, name="node-cache-verify"),
    path("nodes/<str:name>/cache/jobs/<int:pk>/cancel/", views.node_cache_cancel, name="node-cache-cancel"),
]
