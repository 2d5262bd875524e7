"""deploy/Dockerfile (CPU) and deploy/Dockerfile.cuda (issue 31). No container engine runs on our
machines, so the images are never built here: these tests read the Dockerfiles as Docker reads
them and run here what their build steps run (the version read from pyproject.toml, the llama.cpp
build script and its move to /opt/llama.cpp, the wheel built from exactly the files the build stage
copies and installed into a clean venv, the demo wheel's name), and check the final stages: no
compiler, a non-root user, the version label, the `manage.py` entry, the libraries llama-server links.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.conftest import REPO
from tests.deploy.manifests import DOCKERFILES, apt_installs, arg_defaults, copies, env_of, parse_dockerfile

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
COMPILERS = {"build-essential", "gcc", "g++", "clang", "cmake", "make", "git", "cuda-nvcc", "hipcc"}
FLAVOURS = sorted(DOCKERFILES)


def _stages(flavour):
    return parse_dockerfile(DOCKERFILES[flavour])


def _run_text(flavour) -> str:
    _, stages = _stages(flavour)
    return "\n".join(i.args for i in stages[0].all("RUN"))


NOT_SHIPPED = {"tests", "bench"}


def _local_apps() -> set[str]:
    """The console's own packages: its Django apps and the packages they import (live)."""
    from django.conf import settings

    apps = {app for app in settings.INSTALLED_APPS if (REPO / app / "__init__.py").is_file()}
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - NOT_SHIPPED
    assert apps <= packages
    return packages


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_path_the_build_copies_exists(flavour):
    _, stages = _stages(flavour)
    names = [s.name for s in stages]
    for n, stage in enumerate(stages):
        for sources, _dest, from_stage in copies(stage):
            if from_stage is None:
                for src in sources:
                    assert (REPO / src).exists(), f"{DOCKERFILES[flavour].name}: COPY {src}: not in the repository"
            else:
                assert from_stage in names[:n], f"COPY --from={from_stage}: no earlier stage of that name"
    # The console the image runs: manage.py, every local Django app, templates and static files.
    copied = {src.rstrip("/") for sources, _, f in copies(stages[0]) if f is None for src in sources}
    assert _local_apps() | {"manage.py", "templates", "static", "pyproject.toml"} <= copied
    assert "xgenconsole" in _local_apps() and "history" in _local_apps()  # the scan found them


def test_the_wheel_packages_every_local_app():
    # The build installs the console's wheel for its dependencies; an app missing from
    # packages.find (history was) would be missing from any install of the wheel.
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    missing = {app for app in _local_apps() if f"{app}*" not in include}
    assert not missing, f"INSTALLED_APPS not in [tool.setuptools.packages.find] include: {missing}"


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_final_stage_runs_the_console_without_a_compiler_as_a_user(flavour):
    global_args, stages = _stages(flavour)
    assert len(stages) >= 2, "multi-stage: a build stage and the final one"
    final = stages[-1]
    base = final.base
    for key, value in global_args.items():
        base = base.replace(f"${{{key}}}", value)
    assert "devel" not in base and not (apt_installs(final) & COMPILERS), (base, apt_installs(final))
    assert not any(p.endswith("-dev") for p in apt_installs(final))
    assert {f for _, _, f in copies(final)} == {stages[0].name}, "the final stage copies only what the build made"
    assert arg_defaults(final)["VERSION"] == VERSION
    (label,) = final.all("LABEL")
    assert 'org.opencontainers.image.version="${VERSION}"' in label.args
    (user,) = final.all("USER")
    assert user.args == "10001:10001"  # the manifests' runAsUser (tests/deploy/test_kubernetes.py)
    assert any("useradd" in i.args and "--uid 10001" in i.args for i in final.all("RUN"))
    (entry,) = final.all("ENTRYPOINT")
    assert entry.args == '["python", "manage.py"]'
    assert final.all("WORKDIR")[-1].args == "/app"
    assert ("/src", "/app") in {(s[0], d) for s, d, _ in copies(final)}
    cmd = final.all("CMD")[-1].args
    assert cmd.startswith('["serve"') if flavour == "cpu" else cmd == '["nodeagent"]'
    env = env_of(final)
    # llama-server and its libraries where the final stage puts the build stage's /opt/llama.cpp.
    llama_dest = {d for s, d, _ in copies(final) if s == ["/opt/llama.cpp"]}
    assert llama_dest == {"/opt/llama.cpp"}
    assert env["XGEN_LLAMA_SERVER_BIN"] == "/opt/llama.cpp/bin/llama-server"
    assert env["LLAMA_CPP_LIB_PATH"] == "/opt/llama.cpp/lib"
    assert env["XGEN_DATA_DIR"] == "/var/lib/xgen" and env["PATH"].startswith("/opt/venv/bin:")


def test_the_cuda_image_states_its_architectures():
    global_args, stages = _stages("cuda")
    archs = arg_defaults(stages[0])["CUDA_ARCHS"]
    assert archs == arg_defaults(stages[-1])["CUDA_ARCHS"] == "75;80;86;89;90"
    assert all(f"{a} (" in DOCKERFILES["cuda"].read_text() for a in archs.split(";"))  # each one named in the header
    assert 'XGEN_LLAMA_GPU=cuda XGEN_LLAMA_GPU_ARCHS="$CUDA_ARCHS"' in _run_text("cuda")
    assert 'if [ "$WITH_VLLM" = true ]; then /opt/venv/bin/pip install vllm; fi' in _run_text("cuda")


def test_the_rocm_image_states_its_targets_and_carries_the_rocm_runtime():
    _, stages = _stages("rocm")
    archs = arg_defaults(stages[0])["HIP_ARCHS"]
    assert archs == arg_defaults(stages[-1])["HIP_ARCHS"] == "gfx90a;gfx942;gfx1100"
    assert all(f"{a} (" in DOCKERFILES["rocm"].read_text() for a in archs.split(";"))
    run = _run_text("rocm")
    assert 'XGEN_LLAMA_GPU=hip XGEN_LLAMA_GPU_ARCHS="$HIP_ARCHS"' in run
    assert 'mv "$XGEN_CACHE_DIR/llama.cpp/$v-hip" /opt/llama.cpp' in run
    # The ROCm libraries llama-server links come from the build stage (the final one is plain
    # Ubuntu), where the loader looks for them.
    final = stages[-1]
    assert (["/opt/rocm-runtime/lib"], "/opt/rocm/lib", "build") in copies(final)
    assert any("/etc/ld.so.conf.d/rocm.conf" in i.args and "ldconfig" in i.args for i in final.all("RUN"))
    # The build script puts a GPU build where these Dockerfiles move it from.
    script = (REPO / "deploy" / "build_llama_cpp.sh").read_text()
    assert '[ "$flavour" = cpu ] || prefix="$prefix-$flavour"' in script


def _llama_version_from_the_dockerfile(flavour) -> str:
    sed = re.search(r'v="\$\((sed -n .*? pyproject\.toml)\)"', _run_text(flavour))
    assert sed, "the build stage reads the llama-cpp-python pin from pyproject.toml"
    return subprocess.run(["bash", "-c", sed[1]], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_build_reads_the_pinned_llama_cpp_version(flavour):
    assert _llama_version_from_the_dockerfile(flavour) == metadata.version("llama_cpp_python")


def _cache_dir() -> Path:
    from django.conf import settings

    return Path(settings.CACHE_DIR)


def test_the_llama_cpp_build_step_runs_and_its_result_moves(tmp_path):
    # The CPU image's step: build_llama_cpp.sh VERSION (here: the build bootstrap.sh made, which the
    # script finds complete), then `mv` of llama.cpp/VERSION to /opt/llama.cpp: the move keeps it working.
    version = _llama_version_from_the_dockerfile("cpu")
    assert 'bash deploy/build_llama_cpp.sh "$v" /opt/venv/bin/python' in _run_text("cpu")
    assert 'mv "$XGEN_CACHE_DIR/llama.cpp/$v" /opt/llama.cpp' in _run_text("cpu")
    env = {**os.environ, "XGEN_CACHE_DIR": str(_cache_dir())}
    done = subprocess.run(["bash", "deploy/build_llama_cpp.sh", version, sys.executable], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    build = _cache_dir() / "llama.cpp" / version
    moved = tmp_path / "opt" / "llama.cpp"
    shutil.copytree(build, moved, symlinks=True)
    ran = subprocess.run([str(moved / "bin" / "llama-server"), "--version"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert ran.returncode == 0 and "version:" in ran.stdout + ran.stderr, ran.stdout + ran.stderr
    assert any((moved / "lib").glob("libllama.so*"))  # LLAMA_CPP_LIB_PATH=/opt/llama.cpp/lib
    ldd = subprocess.run(["ldd", str(moved / "bin" / "llama-server")], capture_output=True, text=True).stdout
    assert str(moved / "bin" / "../lib") in ldd and str(build) not in ldd  # $ORIGIN, not the cache path


def test_the_build_script_refuses_a_gpu_build_it_cannot_make():
    for env, message in (({"XGEN_LLAMA_GPU": "cuda"}, "needs XGEN_LLAMA_GPU_ARCHS"),
                         ({"XGEN_LLAMA_GPU": "metal", "XGEN_LLAMA_GPU_ARCHS": "x"}, "must be cuda or hip")):
        done = subprocess.run(["bash", "deploy/build_llama_cpp.sh", "0.0.0", sys.executable], cwd=REPO,
                              env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def _debian_package(path: str) -> str:
    done = subprocess.run(["dpkg", "-S", os.path.realpath(path)], capture_output=True, text=True)
    if done.returncode != 0:  # /lib is a symlink to /usr/lib on Debian 12: dpkg knows one of the two
        done = subprocess.run(["dpkg", "-S", path.replace("/usr/lib/", "/lib/")], capture_output=True, text=True)
    assert done.returncode == 0, f"no Debian package owns {path}"
    return done.stdout.split(":")[0]


def test_llama_server_links_only_what_the_cpu_image_installs():
    # python:3.11-slim-bookworm has glibc, libstdc++ and libgcc; anything else llama-server or its
    # libraries link must be installed by the final stage (libgomp1: OpenMP).
    base = {"libc6", "libstdc++6", "libgcc-s1"}
    installed = base | apt_installs(_stages("cpu")[1][-1])
    build = _cache_dir() / "llama.cpp" / metadata.version("llama_cpp_python")
    assert (build / "build.json").is_file(), f"no llama.cpp build at {build} (deploy/bootstrap.sh makes it)"
    needed: dict[str, str] = {}
    for binary in [build / "bin" / "llama-server", *(build / "lib").glob("*.so*")]:
        for line in subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout.splitlines():
            assert "not found" not in line, f"{binary.name}: {line}"
            m = re.match(r"\s*(\S+) => (/\S+)", line)
            if m and not Path(m[2]).resolve().is_relative_to(build.resolve()):
                needed[m[1]] = _debian_package(m[2])
    assert "libgomp.so.1" in needed  # the scan sees what is linked
    missing = {lib: pkg for lib, pkg in needed.items() if pkg.split(":")[0] not in installed}
    assert not missing, f"linked but not in the final stage: {missing}"


def test_the_wheel_the_build_makes_installs_in_a_clean_venv(tmp_path):
    # The build stage's own steps, on exactly the files it copies: pip wheel, then the install of
    # that wheel into a venv with nothing in it (--no-deps: its dependencies are checked against
    # the ones these tests run on instead of downloaded), then the demo wheel's name.
    _, stages = _stages("cpu")
    run = _run_text("cpu")
    assert "/opt/venv/bin/pip wheel --no-deps --no-build-isolation -w /wheels ." in run
    assert "/opt/venv/bin/pip install /wheels/xgen_console-*.whl" in run
    src = tmp_path / "src"
    for sources, dest, from_stage in copies(stages[0]):
        if from_stage is None:
            for s in sources:
                target = src / dest if dest.endswith("/") and len(sources) == 1 and s.endswith("/") else src / s
                if (REPO / s).is_dir():
                    shutil.copytree(REPO / s, target, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(REPO / s, target)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "wheels"), "."], cwd=src, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob(f"xgen_console-{VERSION}-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        top = {name.split("/")[0] for name in zf.namelist() if not name.split("/")[0].endswith(".dist-info")}
        meta = zf.read(f"xgen_console-{VERSION}.dist-info/METADATA").decode()
    assert top == _local_apps()
    clean = tmp_path / "clean"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(clean)], check=True, timeout=120)
    # pip from these tests' venv, run by the clean venv's Python, installs into the clean venv.
    pip_dir = Path(metadata.distribution("pip").locate_file("pip")).parent
    installed = subprocess.run([str(clean / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                                str(wheel)], env={**os.environ, "PYTHONPATH": str(pip_dir)}, capture_output=True,
                               text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    listed = subprocess.run([str(clean / "bin" / "python"), "-c",
                             "import importlib.metadata as m; d = m.distribution('xgen-console'); "
                             "print(d.version); print(sorted({f.parts[0] for f in d.files if f.suffix == '.py'}))"],
                            capture_output=True, text=True, check=True, cwd=tmp_path).stdout.splitlines()
    assert listed[0] == VERSION and eval(listed[1]) == sorted(_local_apps())  # noqa: S307 (our own print)
    # Each dependency the wheel declares is met by the packages these tests run on.
    unmet = []
    for line in meta.splitlines():
        if line.startswith("Requires-Dist: "):
            req = Requirement(line.removeprefix("Requires-Dist: "))
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                unmet.append(f"{req} (not installed)")
                continue
            if not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{req} (have {have})")
    assert not unmet, unmet
    # The next RUN: the demo chat model's wheel name, asked of the copied source.
    demo = re.search(r'/opt/venv/bin/python -c "(.*?)"\)', run)[1]
    asked = subprocess.run([sys.executable, "-c", demo], cwd=src, capture_output=True, text=True, timeout=120)
    assert asked.returncode == 0, asked.stderr
    requirement, wheel_name = asked.stdout.split()
    assert "==" in requirement and wheel_name.endswith(".whl")
