"""`manage.py check --deploy` is clean under the production settings (XGEN_SECURE=true)."""
import os
import secrets
import subprocess

from tests.conftest import REPO
from tests.procs import PYTHON


def _check(tmp_path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "xgenconsole.settings", "XGEN_DATA_DIR": str(tmp_path), **env},
    )


def test_production_settings_pass_the_deploy_check(tmp_path):
    result = _check(tmp_path, XGEN_SECURE="true", XGEN_SECRET_KEY=secrets.token_urlsafe(64))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_the_deploy_check_fails_without_hardening(tmp_path):
    result = _check(tmp_path, XGEN_SECURE="false")
    assert result.returncode != 0
    assert "SECURE_HSTS_SECONDS" in result.stderr + result.stdout


def test_a_malformed_boolean_stops_start_up(tmp_path):
    result = _check(tmp_path, XGEN_SECURE="yes")
    assert result.returncode != 0 and "XGEN_SECURE must be 'true' or 'false'" in result.stderr
