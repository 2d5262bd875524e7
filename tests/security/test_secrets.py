"""Secrets never appear in a page, an API answer or a log line: the MinIO secret key, the
Django secret key, session ids, and API keys (shown exactly once, on their creation page)."""
from __future__ import annotations

import re

import httpx
import pytest

from tests.conftest import start_console
from tests.procs import stop_process
from tests.security.routes import api_operations, page_routes

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


def test_no_secret_in_pages_api_or_logs(secret_console):
    console = secret_console
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
               "api key": raw_key}

    bodies: dict[str, str] = {}
    for path, _role in page_routes():
        bodies[f"page {path}"] = client.get(path).text
    api = httpx.Client(base_url=console.url, headers={"Authorization": f"Bearer {raw_key}"}, timeout=30)
    for method, path, _role in api_operations():
        if method == "GET":
            bodies[f"api {path}"] = api.get(path).text
    assert len(bodies) >= 10
    for where, body in bodies.items():
        for name, value in secrets.items():
            assert value not in body, f"{name} appears in {where}"
    log = console.log
    for name, value in secrets.items():
        assert value not in log, f"{name} appears in the server log"
