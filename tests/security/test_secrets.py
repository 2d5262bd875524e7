"""Secrets never appear in a page, an API answer or a log line: the MinIO secret key, the
Django secret key, session ids, API keys (shown exactly once, on their creation page), and the
secret each backend requires (held by the agent and the proxy only)."""
from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.conftest import ENGINES, llama_server_binary, start_console
from tests.procs import stop_process
from tests.security.routes import api_operations, page_routes
from tests.serving.conftest import set_console_backends, wait_api

MINIO_SECRET = "minio-secret-marker-7Q2kLp"
DJANGO_SECRET = "django-secret-marker-" + "x" * 40


@pytest.fixture(scope="module")
def secret_console(tmp_path_factory, s3_server):
    console = start_console(tmp_path_factory.mktemp("secrets"), extra_env={
        "MINIO_ENDPOINT": s3_server.endpoint, "MINIO_ACCESS_KEY": s3_server.access_key,
        "MINIO_SECRET_KEY": MINIO_SECRET, "XGEN_SECRET_KEY": DJANGO_SECRET,
    })
    yield console
    stop_process(console.proc, timeout=30)


def _login(console) -> httpx.Client:
    client = httpx.Client(base_url=console.url, timeout=30)
    client.get("/accounts/login/")
    response = client.post("/accounts/login/", data={
        "username": console.admin_user, "password": console.admin_password,
        "csrfmiddlewaretoken": client.cookies.get("csrftoken")})
    assert response.status_code == 302
    return client


def _load_each_engine(console, tiny_gguf: Path) -> dict[str, dict]:
    """One READY instance per llama.cpp engine: {engine: its API answer}."""
    llama_server_binary()
    set_console_backends(console)
    key = console.manage("createapikey", "--username", "admin").stdout.strip()
    loaded = {}
    for engine in ENGINES:
        r = httpx.post(f"{console.url}/api/management/load", headers={"Authorization": f"Bearer {key}"}, timeout=10,
                       json={"model_path": str(tiny_gguf), "model_name": f"secret-{engine}", "backend": engine})
        assert r.status_code == 202, r.text
        loaded[engine] = r.json()
    for engine, inst in loaded.items():
        url = f"{console.url}/api/management/instances/{inst['id']}"
        loaded[engine] = wait_api(url, key, lambda b: b["state"] in ("READY", "ERROR"))
        assert loaded[engine]["state"] == "READY", loaded[engine]
    return loaded


def _backend_secrets(console, ids: list[int]) -> dict[int, str]:
    code = ("from serving.models import ModelInstance as M; "
            f"print(*M.objects.filter(pk__in={ids!r}).order_by('pk').values_list('pk', 'backend_key'))")
    rows = console.manage("shell", "-v", "0", "-c", code).stdout.strip()
    return {int(pk): secret for pk, secret in re.findall(r"\((\d+), '([A-Za-z0-9_-]+)'\)", rows)}


def test_no_secret_in_pages_api_or_logs(secret_console, tiny_gguf):
    console = secret_console
    loaded = _load_each_engine(console, tiny_gguf)
    ids = [inst["id"] for inst in loaded.values()]
    backend_secrets = _backend_secrets(console, ids)
    assert sorted(backend_secrets) == sorted(ids) and all(len(v) >= 32 for v in backend_secrets.values())
    # The planned command shows where the secret goes, never the secret: llama-server's file stays
    # a placeholder, the Python engines take it from their environment.
    assert "{api_key_file}" in loaded["llama-server"]["command"]
    client = _login(console)
    session_id = client.cookies.get("sessionid")
    assert session_id
    # Create a key through the page: it is shown once, on the page right after creation.
    keys_page = client.get("/keys/")
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', keys_page.text).group(1)
    admin_id = re.search(r'<option value="(\d+)"[^>]*>admin</option>', keys_page.text).group(1)
    created = client.post("/keys/", data={"name": "crawl", "user": admin_id, "csrfmiddlewaretoken": csrf},
                          follow_redirects=True)
    raw_key = re.search(r'id="new-key-value">(xgen_[^<]+)<', created.text).group(1)
    secrets = {"minio secret": MINIO_SECRET, "django secret": DJANGO_SECRET, "session id": session_id,
               "api key": raw_key, **{f"backend secret of instance {pk}": v for pk, v in backend_secrets.items()}}

    bodies: dict[str, str] = {}
    for path, _role in page_routes():
        bodies[f"page {path}"] = client.get(path).text
    api = httpx.Client(base_url=console.url, headers={"Authorization": f"Bearer {raw_key}"}, timeout=30)
    for method, path, _role in api_operations():
        if method == "GET":
            bodies[f"api {path}"] = api.get(path).text
    for pk in ids:  # the instances' own pages, log and API answers (the crawl fills ids with 1)
        for path in (f"/instances/{pk}/", f"/instances/{pk}/log", f"/instances/{pk}/log?run=previous"):
            bodies[f"page {path}"] = client.get(path).text
        bodies[f"api instance {pk}"] = api.get(f"/api/management/instances/{pk}").text
    bodies["api instances"] = api.get("/api/management/instances").text
    for pk in ids:  # what the node keeps: the backend's log file, its command line; no key file is left
        log_dir = console.data_dir / "logs" / "instances" / str(pk)
        for path in log_dir.iterdir():
            bodies[f"file {path}"] = path.read_text(errors="replace")
        assert not list((console.data_dir / "run").rglob("api-key")), "the key file is removed once read"
    for inst in loaded.values():
        cmdline = Path(f"/proc/{inst['pid']}/cmdline").read_bytes().decode(errors="replace")
        bodies[f"command line of pid {inst['pid']}"] = cmdline.replace("\0", " ")
    assert len(bodies) >= 10
    for where, body in bodies.items():
        for name, value in secrets.items():
            assert value not in body, f"{name} appears in {where}"
    log = console.log
    for name, value in secrets.items():
        assert value not in log, f"{name} appears in the server log"
