"""Sign-in with an OpenID Connect provider (XGEN_OIDC_*), through Authlib's Django client.

Authlib does the protocol: discovery from the issuer, the authorization code flow with PKCE (S256),
state and nonce kept in the session and used once, and the ID token checked (signature against the
provider's JWKS, fetched again when a token names a key it does not hold: key rotation; iss, aud,
exp, iat, nonce, at_hash). This module maps the verified claims to a console user, syncs the groups
(accounts.sso) and refreshes the tokens when the session is re-checked.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

import requests
from authlib.common.errors import AuthlibBaseError
from authlib.integrations.base_client.errors import MismatchingStateError, OAuthError
from authlib.integrations.django_client import OAuth
from django.conf import settings
from django.contrib.auth import login
from django.contrib.auth.decorators import login_not_required
from django.contrib.auth.forms import AuthenticationForm
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET
from joserfc.errors import JoseError

from accounts.audit import record_audit
from accounts.models import AuditOutcome, IdpSource, Role, User
from accounts.sso import IDP_BACKEND, SESSION_KEY, apply_groups, deprovision, sso_context

log = logging.getLogger("xgen.sso")

NEXT_KEY = "xgen_oidc_next"
HTTP_TIMEOUT_S = 10
_clients: dict[tuple, Any] = {}  # Authlib's DjangoOAuth2App (untyped)
_lock = threading.Lock()


class ProviderError(Exception):
    """The provider could not be used (unreachable, or its discovery document is wrong)."""


def enabled() -> bool:
    return bool(settings.OIDC_ISSUER and settings.OIDC_CLIENT_ID)


def client():
    """Authlib's client for the configured provider, one per process (it keeps the discovery
    document and the JWKS, and fetches the JWKS again for a key id it does not know)."""
    key = (settings.OIDC_ISSUER, settings.OIDC_CLIENT_ID, settings.OIDC_CLIENT_SECRET, settings.OIDC_SCOPES)
    with _lock:
        found = _clients.get(key)
        if found is None:
            oauth = OAuth()
            found = oauth.register(
                name="xgen", client_id=settings.OIDC_CLIENT_ID, client_secret=settings.OIDC_CLIENT_SECRET or None,
                server_metadata_url=f"{settings.OIDC_ISSUER}/.well-known/openid-configuration",
                client_kwargs={"scope": settings.OIDC_SCOPES, "code_challenge_method": "S256",
                               "default_timeout": HTTP_TIMEOUT_S},
            )
            _clients.clear()
            _clients[key] = found
    try:
        metadata = found.load_server_metadata()
    except (requests.RequestException, ValueError) as exc:
        raise ProviderError(f"discovery failed: {exc}") from None
    if metadata.get("issuer", "").rstrip("/") != settings.OIDC_ISSUER:
        # OpenID Connect Discovery 1.0 §4.3: the document must name the issuer it was fetched for.
        found.server_metadata.clear()
        raise ProviderError(f"the discovery document names issuer {metadata.get('issuer')!r}, "
                            f"not XGEN_OIDC_ISSUER {settings.OIDC_ISSUER!r}")
    return found


def claims_options() -> dict:
    """iss is the configured issuer, and aud must hold our client id: Authlib checks aud only through
    azp, so a token for another client that names us as azp would pass without this."""
    return {"iss": {"essential": True, "values": [settings.OIDC_ISSUER, settings.OIDC_ISSUER + "/"]},
            "aud": {"essential": True, "values": [settings.OIDC_CLIENT_ID]}}


def redirect_uri(request: HttpRequest) -> str:
    return settings.OIDC_REDIRECT_URI or request.build_absolute_uri(reverse("oidc-callback"))


def _refused(request: HttpRequest, reason: str, *, status: int = 400, tried: str = "") -> HttpResponse:
    record_audit(action="login_failed", actor=tried, target=tried, request=request, outcome=AuditOutcome.REFUSED,
                 detail={"source": "oidc", "reason": reason[:300]})
    context = {"form": AuthenticationForm(request), "sso_error": f"Sign-in with {settings.OIDC_NAME} failed: {reason}.",
               "oidc_enabled": True, **sso_context(request)}
    return render(request, "accounts/login.html", context, status=status)


@login_not_required
@require_GET
def oidc_login(request: HttpRequest) -> HttpResponse:
    """Off to the provider's sign-in page (state, nonce and the PKCE verifier stay in the session)."""
    if not enabled():
        raise Http404("single sign-on is not configured")
    target = request.GET.get("next", "")
    allowed = url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()},
                                              require_https=request.is_secure())
    request.session[NEXT_KEY] = target if allowed and target else ""
    try:
        oidc = client()
        return oidc.authorize_redirect(request, redirect_uri(request), nonce=secrets.token_urlsafe(24))
    except (ProviderError, requests.RequestException) as exc:
        log.warning("OIDC provider %s: %s", settings.OIDC_ISSUER, exc)
        return _refused(request, "the identity provider cannot be reached", status=502)


def _claims(request: HttpRequest) -> tuple[dict, dict]:
    """The verified ID token's claims and the token response; ValueError(reason) if refused."""
    oidc = client()
    try:
        token = oidc.authorize_access_token(request, leeway=settings.OIDC_CLOCK_SKEW_S, claims_options=claims_options())
    except MismatchingStateError:
        raise ValueError("the sign-in state is unknown or was used already") from None
    except AuthlibBaseError as exc:  # the provider's error, or one Authlib found in its answer (no code)
        raise ValueError(f"the provider said {exc.error}") from None
    except JoseError as exc:
        raise ValueError(f"the ID token is not valid ({type(exc).__name__}: {exc})") from None
    if "userinfo" not in token:
        raise ValueError("the provider sent no ID token")
    return dict(token["userinfo"]), token


def _groups(claims: dict, token: dict) -> list[str] | None:
    """The groups claim from the ID token, else from the userinfo endpoint; None when absent."""
    name = settings.OIDC_GROUPS_CLAIM
    groups = claims.get(name)
    if groups is None and client().load_server_metadata().get("userinfo_endpoint"):
        try:
            info = client().userinfo(token=token)
        except (requests.RequestException, OAuthError, ValueError) as exc:
            log.warning("OIDC userinfo: %s", exc)
            return None
        if info.get("sub") != claims.get("sub"):  # OpenID Connect Core 5.3.2
            return None
        groups = info.get(name)
    if groups is None:
        return None
    if isinstance(groups, str):
        return [groups]
    if isinstance(groups, list):
        return [str(g) for g in groups]
    return None


def _username(claims: dict) -> str:
    base = str(claims.get("preferred_username") or claims.get("email") or claims["sub"])[:140]
    if not User.objects.filter(username=base).exists():
        return base
    return f"{base[:130]}-{secrets.token_hex(4)}"  # a local name (or another provider's user) keeps its own


@login_not_required
@require_GET
def oidc_callback(request: HttpRequest) -> HttpResponse:
    if not enabled():
        raise Http404("single sign-on is not configured")
    try:
        claims, token = _claims(request)
    except ValueError as exc:
        return _refused(request, str(exc))
    except (ProviderError, requests.RequestException) as exc:
        log.warning("OIDC provider %s: %s", settings.OIDC_ISSUER, exc)
        return _refused(request, "the identity provider cannot be reached", status=502)
    sub = str(claims["sub"])
    user = User.objects.filter(idp_source=IdpSource.OIDC, idp_subject=sub).first()
    if user is None:
        user = User(username=_username(claims), idp_source=IdpSource.OIDC, idp_subject=sub, local_role="",
                    role=Role.VIEWER)
        user.set_unusable_password()
    user.email = str(claims.get("email") or user.email)[:254]
    user.first_name = str(claims.get("given_name") or user.first_name)[:150]
    user.last_name = str(claims.get("family_name") or user.last_name)[:150]
    user.save()
    if not user.is_active:
        return _refused(request, "this account is deactivated in the console", status=403, tried=user.username)
    apply_groups(user, _groups(claims, token), source="oidc", request=request)
    target = request.session.pop(NEXT_KEY, "")
    login(request, user, backend=IDP_BACKEND)
    request.session[SESSION_KEY] = {"source": "oidc", "checked": time.time(),
                                    "refresh_token": token.get("refresh_token") or ""}
    return redirect(target or settings.LOGIN_REDIRECT_URL)


def recheck(request: HttpRequest, user: User, state: dict) -> tuple[bool, dict]:
    """Refresh the session's tokens: the provider refusing ends the session (and deprovisions the
    user: XGEN_SSO_DEPROVISIONED_KEYS); a new ID token's groups are synced."""
    refresh = state.get("refresh_token")
    if not refresh:
        log.info("OIDC session of %s has no refresh token: it ends at its check", user.username)
        return False, state
    try:
        oidc = client()
        token = oidc.fetch_access_token(grant_type="refresh_token", refresh_token=refresh)
    except AuthlibBaseError as exc:
        deprovision(user, source="oidc", reason=f"refresh refused: {exc.error}", request=request)
        return False, state
    except (ProviderError, requests.RequestException) as exc:
        log.warning("OIDC refresh for %s: the provider cannot be reached (%s); the session ends", user.username, exc)
        return False, state
    if token.get("id_token"):
        try:
            claims = dict(oidc.parse_id_token(token, nonce=None, leeway=settings.OIDC_CLOCK_SKEW_S,
                                              claims_options=claims_options()))
        except JoseError as exc:
            log.warning("OIDC refresh for %s: ID token refused (%s)", user.username, exc)
            return False, state
        if str(claims.get("sub")) != user.idp_subject:
            return False, state
        groups = _groups(claims, token)
        if groups is not None:  # a refresh without the claim changes nothing (the sign-in audited that)
            apply_groups(user, groups, source="oidc", request=request)
    return True, {**state, "refresh_token": token.get("refresh_token") or refresh}
