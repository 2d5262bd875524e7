"""axe-core (from the npm registry, kept out of the product): fetched once into a cache dir
outside the repository and injected by Playwright into each page under test."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

AXE_VERSION = "4.14.1"  # MPL-2.0; pinned so a new rule set never fails a build by surprise
AXE_DIR = Path(os.environ.get("XGEN_AXE_DIR", Path.home() / ".cache" / "xgen" / "axe"))
AXE_JS = AXE_DIR / "node_modules" / "axe-core" / "axe.min.js"
BLOCKING = ("serious", "critical")


def axe_source() -> str:
    """axe.min.js, installed with npm into AXE_DIR on first use (deploy/bootstrap.sh test does it too)."""
    if not AXE_JS.is_file():
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail(f"axe-core is not in {AXE_DIR} and npm is missing: apt-get install npm, then "
                        f"npm install --prefix {AXE_DIR} axe-core@{AXE_VERSION} (deploy/bootstrap.sh test does both)")
        AXE_DIR.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([npm, "install", "--prefix", str(AXE_DIR), "--no-audit", "--no-fund", "--no-save",
                               f"axe-core@{AXE_VERSION}"], capture_output=True, text=True, timeout=300)
        if done.returncode != 0 or not AXE_JS.is_file():
            pytest.fail(f"could not install axe-core@{AXE_VERSION} into {AXE_DIR} with npm: {done.stderr[-2000:]}")
    return AXE_JS.read_text()


def serious_violations(page, source: str) -> list[str]:
    """Run axe on the page as it is now; one line per serious or critical violation and node."""
    page.add_script_tag(content=source)
    result = page.evaluate("async () => await axe.run(document, {resultTypes: ['violations']})")
    out = []
    for v in result["violations"]:
        if v.get("impact") in BLOCKING:
            for node in v["nodes"][:5]:
                out.append(f"{v['impact']} {v['id']}: {v['help']} at {' '.join(node['target'])} "
                           f"({node.get('failureSummary', '')[:200]})")
    return out
