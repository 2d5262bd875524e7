from django.urls import path

from serving.web import dashboard_views, team_views, usage_views, views

urlpatterns = [
    path("", dashboard_views.dashboard, name="home"),
    path("instances/", views.instances_page, name="instances"),
    path("instances/new/", views.load_page, name="instance-load"),
    path("instances/new/verdict", views.load_verdict, name="instance-load-verdict"),
    path("instances/presets/", views.presets_page, name="presets"),
    path("instances/<int:pk>/", views.instance_detail, name="instance-detail"),
    path("instances/<int:pk>/log", views.instance_log, name="instance-log"),
    path("instances/<int:pk>/playground", views.playground, name="instance-playground"),
    path("instances/<int:pk>/unload", views.instance_unload, name="instance-unload"),
    path("instances/<int:pk>/restart", views.instance_restart, name="instance-restart"),
    path("instances/<int:pk>/scale", views.instance_scale, name="instance-scale"),
    path("instances/<int:pk>/adapters", views.instance_adapters, name="instance-adapters"),
    path("usage/", usage_views.usage_page, name="usage"),
    path("requests/", usage_views.requests_page, name="requests"),
    path("teams/", team_views.teams_page, name="teams"),
    path("teams/<int:team_id>/", team_views.team_detail, name="team-detail"),
]
