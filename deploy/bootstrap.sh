#!/usr/bin/env bash
# Set up XGEN Console on a fresh Debian machine and run it (`run`) or its tests (`test`).
#   bash deploy/bootstrap.sh run    # venv, install, migrate, admin, demo model, serve on 127.0.0.1:8000
#   bash deploy/bootstrap.sh test   # venv, install (+ chromium, PostgreSQL, Redis as root), all tests
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-run}"
case "$mode" in run|test) ;; *) echo "usage: $0 run|test" >&2; exit 2 ;; esac

is_root() { [ "$(id -u)" = 0 ]; }
have() { command -v "$1" >/dev/null 2>&1; }

# Debian packages: a C/C++ toolchain and cmake build llama-cpp-python; tests also need a browser,
# PostgreSQL and Redis. Installed only when missing, and only when we may (root).
pkgs=()
have python3.11 || pkgs+=(python3.11 python3.11-venv python3.11-dev)
have cc || pkgs+=(build-essential)
have cmake || pkgs+=(cmake)
have git || pkgs+=(git)
if [ "$mode" = test ]; then
  have chromium || pkgs+=(chromium)
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
# llama-cpp-python builds from source (4-7 min on 2 cores); pip caches the wheel, so later
# installs reuse it. GGML_NATIVE=OFF keeps the wheel portable across CPUs.
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}"
extras=""
[ "$mode" = test ] && extras="[test]"
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
.venv/bin/python -m pip install -q -e ".${extras}" 2>&1 | grep -v -e "is ignored" -e "^ *$" || true
.venv/bin/python -c "import django, llama_cpp, channels, minio, gguf" # fail loudly if the install did not take

if [ "$mode" = run ]; then
  .venv/bin/python manage.py migrate -v0
  .venv/bin/python manage.py ensureadmin
  exec .venv/bin/python manage.py serve --host "${XGEN_HOST:-127.0.0.1}" --port "${XGEN_PORT:-8000}"
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
status=0
.venv/bin/python -m pytest "${@:2}" || status=$?
# Browser tests use sync Playwright, which cannot share a process with the asyncio tests.
.venv/bin/python -m pytest -m browser || status=$?
exit $status
