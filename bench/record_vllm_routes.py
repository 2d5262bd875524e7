"""Record the HTTP routes of real vLLM releases, for the proxy's route allowlist test (not run by CI).

Each version's wheel is downloaded without its dependencies (nothing is installed or run); every
route its API server can register is read from the decorators and add_api_route calls in
vllm/entrypoints/ (the routes behind a setting, such as runtime LoRA loading or the dev-mode
routes, included). Kept, in tests/serving/vllm_routes/<version>.txt: `METHOD PATH  module` lines.

    python3 bench/record_vllm_routes.py 0.15.1 0.17.0 0.33.0 [--wheels /tmp/vllm-wheels]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "serving" / "vllm_routes"
DECORATOR = re.compile(r"""@\w+\.(get|post|put|delete|patch|api_route)\(\s*["']([^"']+)["']""")
ADD_ROUTE = re.compile(r"""\.add_api_route\(\s*["']([^"']+)["']""")


def wheel_for(version: str, root: Path) -> Path:
    found = sorted(root.glob(f"vllm-{version}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary",
                        ":all:", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "--platform",
                        "manylinux_2_31_x86_64", "--platform", "manylinux_2_35_x86_64", "-d", str(root)], check=True)
        found = sorted(root.glob(f"vllm-{version}-*.whl"))
    return found[0]


def routes_of(wheel: Path) -> list[tuple[str, str, str]]:
    """(METHOD, path, module) for every route registered under vllm/entrypoints/."""
    out = set()
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not (name.startswith("vllm/entrypoints/") and name.endswith(".py")):
                continue
            text = archive.read(name).decode("utf-8", "replace")
            for method, path in DECORATOR.findall(text):
                out.add(("ANY" if method == "api_route" else method.upper(), path, name))
            for path in ADD_ROUTE.findall(text):
                out.add(("ANY", path, name))
    return sorted(out, key=lambda r: (r[1], r[0], r[2]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("versions", nargs="+")
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/vllm-wheels"))
    args = parser.parse_args()
    args.wheels.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    for version in args.versions:
        wheel = wheel_for(version, args.wheels)
        lines = [f"# vLLM {version}: routes registered under vllm/entrypoints/ ({wheel.name})"]
        lines += [f"{method} {path}  {module}" for method, path, module in routes_of(wheel)]
        (OUT / f"{version}.txt").write_text("\n".join(lines) + "\n")
        print(f"{version}: {len(lines) - 1} routes -> {OUT / f'{version}.txt'}")


if __name__ == "__main__":
    main()
