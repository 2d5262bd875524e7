"""The dashboard page (the home page)."""
from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET

from accounts.auth import role_required
from accounts.models import Role
from history.samples import DEFAULT_RANGE, RANGES
from serving.proxy.cluster_admission import degraded_since
from serving.web.dashboard import dashboard_context


@role_required(Role.VIEWER)
@require_GET
def dashboard(request: HttpRequest) -> HttpResponse:
    """Instance states, latest events, node/GPU and model charts over ?range=1h|24h|7d; htmx
    requests (a resync after a hidden tab) get the live parts only.

    The charts are the whole fleet's (every node's GPUs, every team's traffic per model): a team
    lead held to its teams (issue 26) is sent to its team's page instead (its usage, keys and the
    GPUs its models hold), or to the list of its teams when it leads several."""
    teams = request.user.team_scope()
    if teams is not None:
        return redirect("team-detail", team_id=min(teams)) if len(teams) == 1 else redirect("teams")
    rng = RANGES.get(request.GET.get("range", DEFAULT_RANGE), RANGES[DEFAULT_RANGE])
    context = dashboard_context(rng)
    context["admission_degraded"] = degraded_since() is not None
    if request.htmx:
        return render(request, "serving/partials/_dash_live.html", context)
    return render(request, "serving/dashboard.html", context)
