"""Routes of the project, read from the URLconf and the Ninja API (for matrix tests and crawls)."""
from __future__ import annotations

import re

from django.urls import URLPattern, URLResolver, get_resolver

from accounts.auth import ApiKeyAuth, SessionAuthWithCsrf

# Single sign-on (issue 26): public, as a sign-in page is; 404 while XGEN_OIDC_ISSUER is unset (so in
# the matrix). tests/security/test_sso_routes.py checks them configured, against a real provider.
SSO_PAGES = {"/accounts/oidc/login/", "/accounts/oidc/callback/"}
PUBLIC_PAGES = {"/health", "/healthz", "/readyz", "/accounts/login/", *SSO_PAGES}
MISSING_ID = "999999"
# Routes added for 0.2 (issue 14) and the role each needs; the matrix fails if one goes missing.
ADDED_PAGES = {("/usage/", None), ("/requests/", None), ("/audit/", "admin"), ("/keys/1/", "admin"),
               ("/", "viewer"),  # the dashboard (issue 16)
               ("/teams/", None), ("/teams/1/", None),
               ("/instances/presets/", "operator")}  # engine presets (issue 27 #3)  # teams (issue 26): admins, and a lead its own team
ADDED_API = {
    ("POST", "/api/keys", "admin"), ("GET", "/api/keys", "admin"), ("GET", f"/api/keys/{MISSING_ID}", "admin"),
    ("PATCH", f"/api/keys/{MISSING_ID}", "admin"), ("DELETE", f"/api/keys/{MISSING_ID}", "admin"),
    ("GET", "/api/usage", "viewer"), ("GET", "/api/usage/chargeback", "viewer"), ("GET", "/api/requests", "viewer"),
    ("GET", "/api/audit", "admin"),
    ("POST", "/api/management/start", "operator"),  # issue 13: start an IDLE on_demand instance
    ("POST", "/api/management/scale", "operator"),  # issue 30: a model's replica count
    ("POST", "/api/management/autoscale", "operator"),  # issue 30: its autoscaling settings
    ("POST", "/api/management/rollout", "operator"),  # issue 30: a rolling restart of its replicas
    # Engine presets (issue 27 #3): reading them is for those who load (operators), as changing them is.
    ("GET", "/api/management/presets", "operator"), ("PUT", "/api/management/presets", "operator"),
    ("DELETE", "/api/management/presets", "operator"),
    ("POST", "/api/management/adapters", "operator"), ("DELETE", "/api/management/adapters", "operator"),
    # Teams (issue 26): admins change teams; reading a team and its keys is for admins and the team's
    # lead (the view holds a lead to its own teams: 404 for another; test_auth_matrix checks it).
    ("GET", "/api/teams", "viewer"), ("POST", "/api/teams", "admin"), ("GET", f"/api/teams/{MISSING_ID}", "viewer"),
    ("PATCH", f"/api/teams/{MISSING_ID}", "admin"), ("DELETE", f"/api/teams/{MISSING_ID}", "admin"),
    ("POST", f"/api/teams/{MISSING_ID}/members", "admin"),
    ("DELETE", f"/api/teams/{MISSING_ID}/members/{MISSING_ID}", "admin"),
    ("GET", f"/api/teams/{MISSING_ID}/keys", "viewer"), ("POST", f"/api/teams/{MISSING_ID}/keys", "viewer"),
    ("DELETE", f"/api/teams/{MISSING_ID}/keys/{MISSING_ID}", "viewer"),
}
# What the proxy (the ASGI app ahead of Django) answers, beyond the Ninja operations it mirrors:
# the engines' inference routes (serving/adapters inference_routes). (method, path, role); checked
# against a real console in tests/proxy/test_api_routes.py.
PROXY_ROUTES = [
    ("GET", "/v1/models", "viewer"),
    ("POST", "/v1/chat/completions", "viewer"),
    ("POST", "/v1/completions", "viewer"),
    ("POST", "/v1/embeddings", "viewer"),
    ("POST", "/v1/responses", "viewer"),
    ("POST", "/v1/messages", "viewer"),
    ("POST", "/v1/messages/count_tokens", "viewer"),
    ("POST", "/v1/audio/transcriptions", "viewer"),
    ("POST", "/v1/audio/translations", "viewer"),
    ("POST", "/v1/chat/completions/input_tokens", "viewer"),
    ("POST", "/v1/responses/input_tokens", "viewer"),
    ("POST", "/v1/rerank", "viewer"),
    ("POST", "/v1/reranking", "viewer"),
    ("POST", "/v1/score", "viewer"),
    ("POST", "/api/inference/v1/rerank", "viewer"),
    ("POST", "/api/inference/v1/score", "viewer"),
    *[("POST", f"/api/inference/{route}", "viewer") for route in (
        "tokenize", "detokenize", "apply-template", "infill", "rerank", "score", "pooling", "classify")],
    ("POST", "/api/inference/v1/messages", "viewer"),
    ("GET", "/metrics", "viewer"),
]
SAMPLE = {"int": "1", "str": "n", "path": "gguf/x", "slug": "x", "uuid": "00000000-0000-0000-0000-000000000000"}


def _fill(route: str) -> str:
    return re.sub(r"<(?:(\w+):)?\w+>", lambda m: SAMPLE[m.group(1) or "str"], route)


def page_routes() -> list[tuple[str, str | None]]:
    """(path, required role or None) for every non-API page."""
    out = []

    def walk(patterns, prefix=""):
        for p in patterns:
            if isinstance(p, URLResolver):
                walk(p.url_patterns, prefix + str(p.pattern))
            elif isinstance(p, URLPattern):
                route = prefix + str(p.pattern)
                if route.startswith(("api/", "^api/")):
                    continue
                path = "/" + _fill(route)
                out.append((path, getattr(p.callback, "required_role", None)))

    walk(get_resolver().url_patterns)
    return out


def api_operations() -> list[tuple[str, str, str]]:
    """(method, concrete path, required role) for every Ninja operation."""
    from xgenconsole.api import api

    out = []
    for bound in api._get_bound_routers():  # ninja clones each operation with its effective auth
        for path, view in bound.path_operations.items():
            full = "/api/" + "/".join(p.strip("/") for p in (bound.prefix, path) if p.strip("/"))
            # An id no row has: the matrix checks auth, and must not revoke its own keys (DELETE /api/keys/{id}).
            full = re.sub(r"\{(?:(\w+):)?(\w+)\}", lambda m: "gguf/x" if m.group(1) == "path" else MISSING_ID, full)
            for op in view.operations:
                assert op.auth_callbacks, f"{full} has no auth"
                roles = {cb.role for cb in op.auth_callbacks if isinstance(cb, ApiKeyAuth | SessionAuthWithCsrf)}
                assert len(roles) == 1 and len(op.auth_callbacks) == 2, f"{full}: use auth=auth_for(role)"
                role = roles.pop()
                for method in op.methods:
                    out.append((method, full, role))
    return out
