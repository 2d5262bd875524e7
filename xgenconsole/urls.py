from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path

from xgenconsole import views
from xgenconsole.api import api

urlpatterns = [
    path("", views.home, name="home"),
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
    path(
        "accounts/login/",
        auth_views.LoginView.as_view(template_name="registration/login.html", redirect_authenticated_user=True),
        name="login",
    ),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("users/", views.users_page, name="users"),
    path("users/<int:user_id>/", views.user_edit, name="user-edit"),
    path("keys/", views.keys_page, name="keys"),
    path("keys/<int:key_id>/revoke/", views.key_revoke, name="key-revoke"),
    path("api/", api.urls),
    # Anything else under /api/ answers JSON, never Django's HTML 404.
    re_path(r"^api/.*$", views.api_not_found),
    path("", include("hardware.urls")),
    path("", include("hub.urls")),
    path("", include("serving.urls")),
]

handler404 = "xgenconsole.views.not_found"
handler500 = "xgenconsole.views.server_error"
