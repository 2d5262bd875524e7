"""A llama.cpp build in progress, as `deploy/build_llama_cpp.sh` leaves it beside its cache.

`deploy/bootstrap.sh run` starts the console while llama.cpp still compiles (minutes on a small
machine): the node shows "llama.cpp building: N %" and a load asked for meanwhile waits for the
build, then goes on. The script writes, next to the build it makes (`llama.cpp/VERSION`):

- `VERSION.building` while it compiles: {pid, version, commit, flavour, started, log, phase, libs};
  removed when it ends. A file whose pid is gone (a build killed with SIGKILL) counts as failed.
  It compiles in two phases, each with its own log: `libraries` (libllama and the ggml libraries
  it links), then `llama-server`. A CPU build stages the libraries in `VERSION.lib` between the
  two (`libs` names it): llama-cpp-python loads them while llama-server compiles.
- `VERSION.failed` after a failed build: {error, tail, at}; removed by the next good build.

The percentage is the largest of the last `[ NN%]` lines (make) or `[N/M]` lines (ninja) of the
build's log: what CMake itself prints as it goes.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MAKE_RE = re.compile(rb"^\[\s*(\d{1,3})%\]", re.M)
_NINJA_RE = re.compile(rb"^\[(\d+)/(\d+)\]", re.M)
TAIL_BYTES = 8192
# Flavours as the build script names them -> as the backend probe names them.
FLAVOURS = {"cpu": "cpu", "cuda": "cuda", "hip": "rocm"}


@dataclass(frozen=True)
class BuildState:
    """One llama.cpp version's build beside the cache: `state` is building or failed."""

    version: str
    state: str
    percent: int | None = None
    commit: str = ""
    llama_version: str = ""
    flavour: str = "cpu"
    started: float = 0.0
    error: str = ""
    prefix: Path | None = None
    phase: str = ""  # libraries | llama-server ("" from a script before the phases)
    libs: Path | None = None  # the staged libraries (VERSION.lib), once the first phase is done

    @property
    def label(self) -> str:
        """What the node's pages and the waiting load say (the percent is the phase's own)."""
        if self.state == "building":
            done = f"{self.percent} %" if self.percent is not None else "configuring"
            if self.phase == "libraries":
                done = f"libraries {done}, then llama-server"
            elif self.phase == "llama-server":
                done = f"llama-server {done}" + (" (its libraries are ready)" if self.libs else "")
            return f"llama.cpp {self.version} building: {done}"
        return f"llama.cpp {self.version} build failed: {self.error}"

    @property
    def llama_server_version(self) -> str:
        """What the finished llama-server will report, as hardware.backends reads its `--version`:
        the script builds with build number 0 and the source package's commit, so a llama.cpp that
        states its own version at configure (`-- llama.cpp version: 0.5.0-dev`) prints
        "0.5.0-dev (build 0, commit C)", an older one "0 (C)"."""
        commit = self.commit or "unknown"
        if self.llama_version:
            return f"{self.llama_version} (build 0, commit {commit})"
        return f"0 ({commit})"

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "state": self.state, "percent": self.percent,
                "flavour": FLAVOURS.get(self.flavour, self.flavour), "started": self.started,
                "error": self.error, "label": self.label, "phase": self.phase,
                "libraries_ready": self.libs is not None}


def build_in_rows(backends: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The build (BuildState.to_json) that a node's backend rows name, else None."""
    return next((b["build"] for b in backends or [] if isinstance(b.get("build"), dict)), None)


def build_percent(log: Path) -> int | None:
    """CMake's own progress from the end of a build log; None before the first step."""
    try:
        with log.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            tail = f.read()
    except OSError:
        return None
    percents = [int(m) for m in _MAKE_RE.findall(tail)]
    percents += [int(100 * int(done) / int(total)) for done, total in _NINJA_RE.findall(tail) if int(total)]
    return min(100, max(percents)) if percents else None


def _alive(pid: int) -> bool:
    """The build's own shell still runs: the pid exists, is no zombie, and is that script (a pid
    reused after a killed build is not taken for it)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z" and b"build_llama_cpp" in cmdline


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def build_state(root: Path, version: str) -> BuildState | None:
    """The build of `version` under `root` (the cache's llama.cpp folder) while it runs or after it
    failed; None when none runs and the last one did not fail (built, or never started)."""
    prefix = root / version
    running = _read(root / f"{version}.building")
    if running is not None:
        pid = running.get("pid")
        if isinstance(pid, int) and _alive(pid):
            libs = str(running.get("libs") or "")
            return BuildState(version=version, state="building", percent=build_percent(Path(str(running.get("log")))),
                              commit=str(running.get("commit") or ""),
                              llama_version=str(running.get("llama_version") or ""), flavour=str(running.get("flavour") or "cpu"),
                              started=float(running.get("started") or 0), prefix=prefix,
                              phase=str(running.get("phase") or ""), libs=Path(libs) if libs else None)
        if not (prefix / "build.json").is_file():
            return BuildState(version=version, state="failed", commit=str(running.get("commit") or ""),
                              error=f"the build (pid {pid}) stopped without finishing; run deploy/bootstrap.sh "
                                    "again to build it", prefix=prefix)
    failed = _read(root / f"{version}.failed")
    if failed is not None and not (prefix / "build.json").is_file():
        return BuildState(version=version, state="failed", error=str(failed.get("error") or "unknown error")[:300],
                          started=float(failed.get("at") or 0), prefix=prefix)
    return None

