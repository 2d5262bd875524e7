"""Typed readers for settings that come from the environment.

Each reader refuses a malformed value at start-up instead of guessing, so a typo in a
deployment fails loudly rather than silently running with a default.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit


class ImproperEnv(ValueError):
    """An environment variable holds a value its setting cannot take."""


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    """Only `true` or `false` (any case); anything else is an error, not False."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value == "true":
        return True
    if value == "false":
        return False
    raise ImproperEnv(f"{name} must be 'true' or 'false', not {raw!r}")


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ImproperEnv(f"{name} must be an integer, not {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ImproperEnv(f"{name} must be >= {minimum}, not {value}")
    if maximum is not None and value > maximum:
        raise ImproperEnv(f"{name} must be <= {maximum}, not {value}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_dirs(name: str, *, not_inside: dict[str, Path] | None = None) -> list[Path]:
    """Comma-separated absolute folders, resolved (symlinks followed); empty when unset.

    A relative entry is refused, and so is one equal to or inside a folder of `not_inside`
    (setting name -> folder), e.g. an import dir inside the console's own data dir.
    """
    dirs: list[Path] = []
    for item in env_list(name, []):
        path = Path(item).expanduser()
        if not path.is_absolute():
            raise ImproperEnv(f"{name} takes absolute paths only, not {item!r}")
        path = path.resolve()
        for other, folder in (not_inside or {}).items():
            if path.is_relative_to(Path(folder).resolve()):
                raise ImproperEnv(f"{name} entry {item!r} lies inside {other} ({folder}), which no upload may read")
        dirs.append(path)
    return dirs


def env_secret(name: str, default: str = "") -> str:
    """A secret from NAME, or from the file named by NAME_FILE (Docker/Kubernetes secrets)."""
    value = os.environ.get(name)
    if value:
        return value
    path = os.environ.get(f"{name}_FILE")
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise ImproperEnv(f"{name}_FILE={path!r} cannot be read: {exc}") from None
    return default


def persistent_secret_key(data_dir: Path) -> str:
    """A secret key generated once and kept (mode 0600) in the data dir."""
    path = data_dir / "secret_key"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    data_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(50)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key)
    return key


def database_from_url(url: str, *, data_dir: Path) -> dict:
    """A Django DATABASES entry from `sqlite:///path` or `postgres://user:pass@host:port/db`."""
    if not url:
        url = f"sqlite:///{data_dir / 'xgen.sqlite3'}"
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "sqlite":
        path = unquote(parts.path) or str(data_dir / "xgen.sqlite3")
        if path.startswith("//"):
            path = path[1:]
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": path,
            "OPTIONS": {
                "timeout": 30,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
            "TEST": {"NAME": str(Path(path).with_suffix(".test.sqlite3"))},
        }
    if scheme in {"postgres", "postgresql", "pgsql"}:
        options = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        # An unreachable server answers 503 within seconds rather than holding a worker thread
        # for the TCP timeout (minutes). `?connect_timeout=N` in the URL overrides it.
        options.setdefault("connect_timeout", "5")
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(parts.path.lstrip("/")) or "postgres",
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(parts.port or ""),
            "OPTIONS": options,
            # No persistent connections (Django's advice under ASGI: worker threads come and go);
            # should CONN_MAX_AGE be raised, each reuse is health-checked first. Off the request
            # cycle, live.db.run_db does what request_started/finished do.
            "CONN_MAX_AGE": 0,
            "CONN_HEALTH_CHECKS": True,
        }
    raise ImproperEnv(f"DATABASE_URL scheme {scheme!r} is not supported (use sqlite:// or postgres://)")
