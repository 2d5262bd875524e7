"""A viewer opens the GPUs page of a real console and reads this CPU node's hardware."""
import pytest

from tests.browser.conftest import login

pytestmark = pytest.mark.browser


def test_viewer_sees_the_cpu_node_and_its_backends(console, page):
    console.manage("createuser", "--username", "v", "--role", "viewer", "--password", "viewer-pass-123")
    frames: list[str] = []
    page.on("websocket", lambda ws: ws.on("framereceived", lambda payload: frames.append(str(payload))))
    login(page, console.url, "v", "viewer-pass-123")
    page.get_by_role("link", name="GPUs").click()
    card = page.locator(".node-card[data-node=test-node]")
    card.locator(".cpu-only").get_by_text("No GPU detected — CPU node.").wait_for()
    assert card.locator(".badge").inner_text() == "online"
    report = card.locator(".detection-report").inner_text()
    assert "NVML: NVML Shared Library Not Found" in report and "torch: not compiled with CUDA" in report
    assert card.locator(".backends .role-tag", has_text="llama-cpp-python").is_visible()
    page.locator("#live-indicator").get_by_text("● live").wait_for()
    assert page.locator("#count-gpus").inner_text() == "0"

    # The agent's next inventory refresh (every 10 s) replaces its card over the websocket.
    selector = ".node-card[data-node=test-node]"
    page.evaluate(f"document.querySelector('{selector}').dataset.seen = 'before'")
    page.wait_for_function(f"() => !document.querySelector('{selector}').dataset.seen", timeout=30_000)
    assert any('class="card node-card"' in f and 'hx-swap-oob="true"' in f for f in frames)
    assert page.locator(".node-card[data-node=test-node] .cpu-only").is_visible()

    card.get_by_role("link", name="test-node").click()
    row = page.locator("tr[data-backend=llama-cpp-python]")
    assert "available" in row.inner_text() and "cpu" in row.inner_text()
    # llama-server: whatever this machine has (the cached build, or none), as the probe finds it here.
    from hardware.backends import probe_llama_server

    here = probe_llama_server()
    shown = page.locator("tr[data-backend=llama-server]").inner_text()
    if here["available"]:
        assert "available" in shown and here["version"] in shown and here["path"] in shown
    else:
        assert "not found" in shown
    assert page.locator("table.detection tr", has_text="nvml").inner_text().count("did not apply") == 1
