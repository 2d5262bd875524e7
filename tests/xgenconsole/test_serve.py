"""`manage.py serve` for real: web and node agent in one process, stopped by SIGTERM."""
import httpx
import pytest

from tests.conftest import start_console
from tests.procs import stop_process


@pytest.mark.parametrize("server", ["daphne", "uvicorn"])
def test_serve_runs_web_and_agent_and_stops_cleanly(tmp_path, server):
    console = start_console(tmp_path / "data", server=server)
    try:
        assert httpx.get(f"{console.url}/healthz").json() == {"status": "ok"}
        import time

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ready = httpx.get(f"{console.url}/readyz")
            if ready.status_code == 200:
                break
            time.sleep(0.2)
        assert ready.status_code == 200, ready.text
        assert ready.json()["nodes"] == ["test-node"]
        css = httpx.get(f"{console.url}/static/css/console.css")
        assert css.status_code == 200 and "--accent" in css.text
        htmx = httpx.get(f"{console.url}/static/django_htmx/htmx-2.min.js")
        assert htmx.status_code == 200 and len(htmx.content) > 10_000
        page = httpx.get(f"{console.url}/models/")
        assert page.status_code == 302 and "/accounts/login/" in page.headers["location"]
        # A second agent for the same node is refused by the node lock.
        second = console.manage("nodeagent", "--name", "test-node", check=False)
        assert second.returncode != 0 and "another node agent" in second.stderr
    finally:
        code = stop_process(console.proc, timeout=30)
    assert code == 0, console.log
    assert "node agent test-node stopped" in console.log
