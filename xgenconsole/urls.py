from django.urls import include, path, re_path

from xgenconsole import views
from xgenconsole.api import api

urlpatterns = [
    path("healthz", views.healthz, name="healthz"),
    # The route llama-server and vLLM answer (benchmark clients such as guidellm check it first).
    path("health", views.healthz, name="health"),
    path("readyz", views.readyz, name="readyz"),
    path("", include("accounts.urls")),
    path("api/", api.urls),
    # Anything else under /api/ answers JSON, never Django's HTML 404.
    re_path(r"^api/.*$", views.api_not_found),
    path("", include("hardware.urls")),
    path("", include("hub.urls")),
    path("", include("serving.urls")),
]

handler400 = "xgenconsole.views.bad_request"
handler404 = "xgenconsole.views.not_found"
handler500 = "xgenconsole.views.server_error"
