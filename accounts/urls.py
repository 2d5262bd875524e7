from django.contrib.auth import views as auth_views
from django.urls import path

from accounts import oidc, views

urlpatterns = [
    path("accounts/login/", views.SignIn.as_view(), name="login"),
    path("accounts/oidc/login/", oidc.oidc_login, name="oidc-login"),
    path("accounts/oidc/callback/", oidc.oidc_callback, name="oidc-callback"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("accounts/password/", views.PasswordChange.as_view(), name="password-change"),
    path("users/", views.users_page, name="users"),
    path("users/<int:user_id>/", views.user_edit, name="user-edit"),
    path("keys/", views.keys_page, name="keys"),
    path("keys/<int:key_id>/", views.key_edit, name="key-edit"),
    path("keys/<int:key_id>/revoke/", views.key_revoke, name="key-revoke"),
    path("audit/", views.audit_page, name="audit"),
]
