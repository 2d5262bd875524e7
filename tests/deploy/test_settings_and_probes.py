"""What deploy/kubernetes/ and the Dockerfiles tell the console, checked against the console (issue 31):
every setting they set is one the README's configuration table documents (and the code reads), and
the web's probes answer as the kubelet asks them, through the real ASGI app with the manifests' own
settings. The docs-vs-code scan itself is tests/xgenconsole/test_docs_settings.py's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from django.urls import resolve

from tests.conftest import REPO
from tests.deploy.manifests import DOCKERFILES, OVERLAYS, containers, env_of, one, parse_dockerfile, pod_specs
from tests.xgenconsole.test_docs_settings import NAME_RE, SECRETS, config_table, product_reads


def _names_set(overlay: str) -> dict[str, str]:
    """Setting name -> where the overlay sets it (ConfigMap keys, containers' env)."""
    found = {key: "ConfigMap" for key in one(overlay, "ConfigMap")["data"]}
    for name, pod in pod_specs(overlay).items():
        for c in containers(pod):
            found.update({e["name"]: f"{name}/{c['name']}" for e in c.get("env", [])})
    return {k: v for k, v in found.items() if NAME_RE.fullmatch(k)}


def _table_name(name: str) -> str:
    """The configuration table's row for a name: a secret's NAME_FILE is documented by NAME's (*file*) row."""
    base = name.removesuffix("_FILE")
    return base if name.endswith("_FILE") and base in SECRETS else name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_setting_the_manifests_set_is_in_the_configuration_table(overlay):
    table = {name for names, _ in config_table() for name in names}
    reads = product_reads()[0]
    names = _names_set(overlay)
    assert {"XGEN_NODE_NAME", "XGEN_DATA_DIR", "DATABASE_URL_FILE", "XGEN_ALLOWED_HOSTS"} <= set(names)  # the scan
    undocumented = {n: where for n, where in names.items() if _table_name(n) not in table}
    assert not undocumented, f"set by overlays/{overlay} but not in the README's configuration table: {undocumented}"
    unread = {n: where for n, where in names.items() if n not in reads}
    assert not unread, f"set by overlays/{overlay} but read by no code: {unread}"


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_every_setting_the_images_set_is_in_the_configuration_table(flavour):
    table = {name for names, _ in config_table() for name in names}
    _, stages = parse_dockerfile(DOCKERFILES[flavour])
    names = {n for n in env_of(stages[-1]) if NAME_RE.fullmatch(n)}
    assert {"XGEN_LLAMA_SERVER_BIN", "XGEN_DATA_DIR"} <= names
    assert not names - table, f"deploy/{DOCKERFILES[flavour].name} sets undocumented {sorted(names - table)}"


PROBE = """
import asyncio, json, os, sys
os.environ["DJANGO_SETTINGS_MODULE"] = "xgenconsole.settings"
from xgenconsole.asgi import application

async def call(path, headers):
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
             "client": ("10.0.0.1", 40000), "server": ("10.244.1.7", 8000)}
    sent, asked, done = [], [], asyncio.Event()
    async def receive():
        if not asked:
            asked.append(1)
            return {"type": "http.request", "body": b"", "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}
    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()
    await application(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return {"status": sent[0]["status"], "body": body.decode(errors="replace")[:300]}

async def main():
    asks = json.loads(sys.argv[1])
    print(json.dumps([await call(path, headers) for path, headers in asks]))

asyncio.run(main())
"""


def _ask(env: dict[str, str], asks: list[tuple[str, list[tuple[str, str]]]], tmp_path) -> list[dict]:
    """Answers of the real ASGI app, in a process with the manifests' settings (not the tests')."""
    child_env = {k: v for k, v in os.environ.items() if not (NAME_RE.fullmatch(k) or k.startswith("DJANGO_"))}
    child_env.update(env)
    child_env["XGEN_DATA_DIR"] = str(tmp_path / "data")  # no DATABASE_URL: SQLite there, never migrated
    child_env["XGEN_DEMO_MODEL"] = "false"
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(asks)], cwd=REPO, env=child_env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_probes_name_routes_the_web_serves(overlay):
    web = one(overlay, "Deployment", "xgen-web")["spec"]["template"]["spec"]["containers"][0]
    probes = {kind: web[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    names = {kind: resolve(probe["path"]).url_name for kind, probe in probes.items()}
    assert names == {"startupProbe": "healthz", "readinessProbe": "readyz", "livenessProbe": "healthz"}
    ports = {p["name"]: p["containerPort"] for p in web["ports"]}
    assert {probe["port"] for probe in probes.values()} <= set(ports)
    assert ports["http"] == int(web["args"][web["args"].index("--port") + 1])


def test_the_probes_pass_with_the_manifests_settings(tmp_path):
    # The kubelet sends Host: <pod IP>:<port> over plain http unless the probe names headers. With the
    # ConfigMap's XGEN_ALLOWED_HOSTS and XGEN_SECURE=true, that is a 400 (DisallowedHost), and without
    # X-Forwarded-Proto a 301 to https (a probe failure or a probe of something else): the probes'
    # headers must give 200 from /healthz and the readiness check's own JSON from /readyz.
    overlay = "nvidia"
    config = one(overlay, "ConfigMap")["data"]
    assert config["XGEN_SECURE"] == "true"
    web = one(overlay, "Deployment", "xgen-web")["spec"]["template"]["spec"]["containers"][0]
    asks = []
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = web[kind]["httpGet"]
        asks.append((get["path"], [(h["name"], h["value"]) for h in get.get("httpHeaders", [])]))
    kubelet_default = [("Host", "10.244.1.7:8000")]
    asks += [("/healthz", kubelet_default), ("/healthz", [("Host", "localhost")])]
    answers = _ask(dict(config), asks, tmp_path)
    startup, ready, live, bare, no_proto = answers
    assert startup == live == {"status": 200, "body": '{"status": "ok"}'}, answers
    # No migrated database here: readyz says so itself (503 and its reasons), as it would until the Job ran.
    assert ready["status"] in (200, 503) and "status" in json.loads(ready["body"]), ready
    assert bare["status"] == 400, bare  # why the probes name their Host
    assert no_proto["status"] == 301, no_proto  # why they name X-Forwarded-Proto
