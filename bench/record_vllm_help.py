"""Record `vllm serve --help=all` of real vLLM releases, for the adapter's tests (not run by CI).

Each version goes into a throwaway venv (vLLM's wheels are CUDA builds of several GB; no GPU is
needed to print help: the CPU platform is set before the CLI runs). What is kept, in
tests/serving/vllm_help/<version>.txt: every option line of the help (the flag, its aliases and
its choices or metavar), and whether the OpenAI server module the adapter starts exists.

    python3 bench/record_vllm_help.py 0.15.1 0.17.0 0.33.0 [--venvs /tmp/vllm-rec]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "serving" / "vllm_help"
SERVER_MODULE = "vllm/entrypoints/openai/api_server.py"


def venv_for(version: str, root: Path) -> Path:
    venv = root / f"v{version}"
    if not (venv / "bin" / "vllm").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"vllm=={version}"], check=True)
    return venv


# The CLI resolves a platform to build its defaults; without a GPU none is found (0.17: "Failed to
# infer device type"), so the CPU platform is set before the CLI runs. Only the help is printed.
PRINT_HELP = """
import sys, vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()
sys.argv = ["vllm", "serve", sys.argv[1]]
from vllm.entrypoints.cli.main import main
main()
"""


def record(version: str, venv: Path) -> Path:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    python = str(venv / "bin" / "python")
    out = subprocess.run([python, "-c", PRINT_HELP, "--help=all"], env=env, capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0 or "--port" not in out.stdout:  # older releases: no --help=all
        out = subprocess.run([python, "-c", PRINT_HELP, "--help"], env=env, capture_output=True, text=True,
                             timeout=600, check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    options = [line.rstrip() for line in out.stdout.splitlines() if line.startswith("  -")]
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{version}.txt"
    path.write_text(f"# vllm {version}: option lines of `vllm serve --help=all` (bench/record_vllm_help.py)\n"
                    f"# server module {SERVER_MODULE}: {'present' if (site / SERVER_MODULE).exists() else 'absent'}\n"
                    + "\n".join(options) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+")
    parser.add_argument("--venvs", type=Path, default=Path("/tmp/vllm-rec"))
    args = parser.parse_args()
    args.venvs.mkdir(parents=True, exist_ok=True)
    for version in args.versions:
        path = record(version, venv_for(version, args.venvs))
        print(f"vllm {version}: {sum(1 for line in path.read_text().splitlines() if line.startswith('  -'))} "
              f"options -> {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
