"""Pages: Teams (the list; admins create teams) and a team's page (members, keys, limits, this
month's usage and GPU-seconds against its budget, and the GPUs its models hold). Admins see and
change every team; a team's lead sees its own team and makes and revokes its keys; anyone else
gets a 404 for a team, as for one that does not exist."""
from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from accounts.audit import record_audit
from accounts.models import ApiKey, AuditOutcome, Role, Team, TeamMembership, User
from accounts.services import (
    TEAM_LIMIT_FIELDS,
    KeyInputError,
    add_member,
    create_api_key,
    create_team,
    remove_member,
    revoke_api_key,
    update_team,
)
from history.charts import stacked_bars
from serving.models import ModelInstance
from serving.proxy.chargeback import chargeback
from serving.proxy.usage import usage_rows


def _limits_from(post) -> dict:
    """The team limit fields of a form: a number, a list of models (comma separated), or empty
    (unlimited); KeyInputError for a number that is not one."""
    out: dict = {}
    for field in TEAM_LIMIT_FIELDS:
        raw = (post.get(field) or "").strip()
        if field == "allowed_models":
            out[field] = [m.strip() for m in raw.split(",") if m.strip()]
        elif not raw:
            out[field] = None
        elif raw.isascii() and raw.isdigit() and len(raw) <= 16:
            out[field] = int(raw)
        else:
            raise KeyInputError(f"{field} must be a whole number of at least 1, or empty for unlimited.")
    return out


@require_http_methods(["GET", "POST"])
def teams_page(request: HttpRequest) -> HttpResponse:
    """Every team (admins; a lead: the teams it leads), and a form to create one (admins)."""
    user = request.user
    admin = user.has_role(Role.ADMIN)
    if request.method == "POST":
        if not admin:
            raise Http404("No such page.")
        name = request.POST.get("name", "")
        try:
            team = create_team(name=name, slug=request.POST.get("slug") or None, **_limits_from(request.POST))
        except KeyInputError as exc:
            record_audit(action="team_create", target=name[:100], request=request, outcome=AuditOutcome.REFUSED,
                         detail={"reason": str(exc)})
            messages.error(request, str(exc))
            return redirect("teams")
        record_audit(action="team_create", target=f"team {team.pk} ({team.slug})", request=request,
                     detail={"name": team.name, **{f: getattr(team, f) for f in TEAM_LIMIT_FIELDS}})
        messages.success(request, f"Team {team.name} created.")
        return redirect("team-detail", team_id=team.pk)
    teams = Team.objects.all() if admin else Team.objects.filter(memberships__user=user, memberships__is_lead=True)
    rows = [{"team": t, "members": t.memberships.count(), "keys": t.api_keys.filter(revoked_at__isnull=True).count()}
            for t in teams.order_by("name")]
    ctx: dict = {"rows": rows, "admin": admin, "limit_fields": TEAM_LIMIT_FIELDS}
    if admin:
        from accounts.sso import mapping_rows

        ctx["mapping"], ctx["mapping_error"] = mapping_rows()
    return render(request, "serving/teams.html", ctx)


def _team_for(request: HttpRequest, team_id: int) -> Team:
    team = Team.objects.filter(pk=team_id).first()
    if team is None or not request.user.leads(team.pk):
        raise Http404("No such team.")
    return team


def used_models(team: Team, *, since: datetime, until: datetime) -> set[str]:
    """The models the team's keys used in [since, until) while the team owned them."""
    return {r["model"] for r in usage_rows(start=since, end=until, group_by="model", bucket="day",
                                           team_ids={team.pk})}


def lead_visible_instances(user: User) -> set[int] | None:
    """The instances whose GPUs `user` may see on the GPU pages and API (hardware's visibility
    source): for a team lead below operator, those its teams' pages list (the instances serving
    each team's models); None for everyone else: every GPU."""
    teams = user.team_scope() if getattr(user, "is_authenticated", False) else None
    if teams is None:
        return None
    now = datetime.now(tz=UTC)
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    visible: set[int] = set()
    for team in Team.objects.filter(pk__in=teams):
        models = set() if team.allowed_models else used_models(team, since=month, until=now + timedelta(seconds=1))
        visible |= {i["id"] for i in team_gpus(team, models)}
    return visible


def team_gpus(team: Team, models: set[str]) -> list[dict]:
    """The instances serving the team's models (its allowed models, or else the models its keys used
    this month) and the GPUs they hold."""
    names = set(team.allowed_models or []) or models
    if not names:
        return []
    return [{"id": i.pk, "model": i.model_name, "node": i.node.name, "gpus": list(i.gpus or []), "state": i.state}
            for i in ModelInstance.objects.select_related("node").filter(model_name__in=sorted(names))
            .exclude(state="STOPPED").order_by("model_name", "pk")]


@require_http_methods(["GET", "POST"])
def team_detail(request: HttpRequest, team_id: int) -> HttpResponse:
    """One team: members, keys, limits, this month's usage and GPU-seconds; admins change its limits
    and members, admins and its lead make and revoke its keys."""
    team = _team_for(request, team_id)
    admin = request.user.has_role(Role.ADMIN)
    if request.method == "POST":
        return _team_post(request, team, admin=admin)
    now = datetime.now(tz=UTC)
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    rows = usage_rows(start=month, end=now + timedelta(seconds=1), group_by="key", bucket="day", team_ids={team.pk})
    days = sorted({r["bucket_start"] for r in rows})
    index = {d: i for i, d in enumerate(days)}
    series: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(days))
    tokens = requests = 0
    for r in rows:
        used = r["prompt_tokens"] + r["completion_tokens"]
        series[r["key_name"] or f"key {r['key_id']}"][index[r["bucket_start"]]] += used
        tokens += used
        requests += r["requests"]
    chart = stacked_bars(label="Tokens per key this month", labels=[d.strftime("%m-%d") for d in days],
                         series=dict(series), unit="tokens", chart_id="chart-team-tokens") if days else ""
    charge = chargeback(start=month, end=now + timedelta(seconds=1), group_by="key", team_ids={team.pk})
    gpu_seconds = round(sum(i["gpu_seconds"] for i in charge["items"]), 1)
    budget = team.gpu_seconds_month
    # The proxy's figure is this one (serving.proxy.gpu_budget), read every XGEN_TEAM_GPU_BUDGET_REFRESH_S.
    gpu_budget = {"budget": budget, "pct": min(100, round(100 * gpu_seconds / budget)), "used_up": gpu_seconds >= budget,
                  "left": round(max(0.0, budget - gpu_seconds), 1)} if budget else None
    models = used_models(team, since=month, until=now + timedelta(seconds=1))
    ctx = {
        "team": team, "admin": admin,
        "members": team.memberships.select_related("user").order_by("user__username"),
        "keys": ApiKey.objects.select_related("user").filter(team=team).order_by("-created_at"),
        "chart": chart, "tokens": tokens, "requests": requests, "gpu_seconds": gpu_seconds,
        "gpu_budget": gpu_budget,
        "gpus": team_gpus(team, models), "new_key": request.session.pop("new_api_key", None),
        "users": User.objects.filter(is_active=True).order_by("username").values_list("username", flat=True)
        if admin else [],
        "allowed_models_text": ", ".join(team.allowed_models or []),
    }
    response = render(request, "serving/team_detail.html", ctx)
    if ctx["new_key"]:
        response["Cache-Control"] = "no-store"
    return response


def _team_post(request: HttpRequest, team: Team, *, admin: bool) -> HttpResponse:
    action = request.POST.get("action", "")
    target = f"team {team.pk} ({team.slug})"
    if action == "key_create":
        username = request.POST.get("username") or request.user.get_username()
        owner = User.objects.filter(username=username, is_active=True).first()
        if owner is None or not (admin or TeamMembership.objects.filter(team=team, user=owner).exists()):
            record_audit(action="key_create", target=request.POST.get("name", "")[:100], request=request,
                         outcome=AuditOutcome.REFUSED, detail={"team": team.slug, "user": username[:150],
                                                               "reason": "not an active member of the team"})
            messages.error(request, f"{username[:150]!r} is not an active member of the team.")
            return redirect("team-detail", team_id=team.pk)
        key, raw = create_api_key(user=owner, name=request.POST.get("name", "") or "key", team=team,
                                  scopes=["inference"])
        record_audit(action="key_create", target=f"key {key.pk} ({key.name})", request=request,
                     detail={"user": owner.username, "team": team.slug, "scopes": ["inference"]})
        request.session["new_api_key"] = raw
        messages.success(request, f"Key {key.name} created. Copy it now: it is not shown again.")
    elif action == "key_revoke":
        raw_id = request.POST.get("key_id", "")
        key = (ApiKey.objects.filter(pk=int(raw_id), team=team).first()
               if raw_id.isascii() and raw_id.isdigit() and len(raw_id) < 12 else None)
        if key is None:
            raise Http404("No such key in the team.")
        first = revoke_api_key(key=key)
        record_audit(action="key_revoke", target=f"key {key.pk} ({key.name})", request=request,
                     detail={"team": team.slug, **({} if first else {"already_revoked": True})})
        messages.success(request, f"Key {key.name} revoked.")
    elif not admin:
        raise Http404("No such page.")
    elif action == "limits":
        try:
            changed = update_team(team=team, name=request.POST.get("name", team.name), **_limits_from(request.POST))
        except KeyInputError as exc:
            record_audit(action="team_change", target=target, request=request, outcome=AuditOutcome.REFUSED,
                         detail={"reason": str(exc)})
            messages.error(request, str(exc))
            return redirect("team-detail", team_id=team.pk)
        record_audit(action="team_change", target=target, request=request,
                     detail={"changed": changed, **{f: getattr(team, f) for f in TEAM_LIMIT_FIELDS}})
        messages.success(request, "Team saved." if changed else "Nothing changed.")
    elif action in ("member_add", "member_remove"):
        user = User.objects.filter(username=request.POST.get("username", "")[:150]).first()
        if user is None:
            messages.error(request, "No such user.")
            return redirect("team-detail", team_id=team.pk)
        if action == "member_add":
            is_lead = request.POST.get("is_lead") == "on"
            add_member(team=team, user=user, is_lead=is_lead)
            record_audit(action="team_member_add", target=target, request=request,
                         detail={"user": user.username, "is_lead": is_lead})
        elif remove_member(team=team, user=user):
            record_audit(action="team_member_remove", target=target, request=request, detail={"user": user.username})
    else:
        raise Http404("No such action.")
    return redirect("team-detail", team_id=team.pk)
