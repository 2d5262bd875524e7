#!/usr/bin/env bash
# Build llama.cpp (CPU) once from the llama-cpp-python source package on the registry and cache
# it, keyed by version: llama-server for the llama-server backend, and the shared libraries that
# llama-cpp-python loads at run time (LLAMA_CPP_LIB_PATH), so one compile serves both engines.
#
#   bash deploy/build_llama_cpp.sh [--download-only] VERSION [PYTHON]
#
# VERSION is llama-cpp-python's (its sdist vendors llama.cpp at the matching commit, MIT licence).
# PYTHON runs `pip download` (default: python3). Nothing is downloaded from anywhere but the
# package registry pip is configured with. Result, under ${XGEN_CACHE_DIR:-~/.cache/xgen}:
#   sdist/llama_cpp_python-VERSION.tar.gz   the source package (pip installs the binding from it)
#   llama.cpp/VERSION/bin/llama-server      the server
#   llama.cpp/VERSION/lib/                  libllama, libggml*, libmtmd (RPATH $ORIGIN)
#   llama.cpp/VERSION/build.json            written last: present = complete
#   llama.cpp/VERSION.lib/                  CPU builds: libllama and libggml*, staged as soon as they are
#                                           linked (lib.json written last), before llama-server compiles:
#                                           llama-cpp-python loads them minutes before the build ends
#   llama.cpp/VERSION.building              while it compiles: {pid, commit, flavour, started, log, phase,
#                                           libs}; the console reads the progress from that log
#                                           (hardware/llama_build.py)
#   llama.cpp/VERSION.failed                the last build's error, until a build succeeds
# A second run with the same VERSION does nothing (seconds).
#
# GPU builds (the images in deploy/Dockerfile.cuda): XGEN_LLAMA_GPU=cuda (or hip) and
# XGEN_LLAMA_GPU_ARCHS (CUDA compute capabilities "80;86;89;90", or HIP targets "gfx90a;gfx942")
# build into llama.cpp/VERSION-cuda (or -hip) instead; the toolkit (nvcc, hipcc) must be installed.
set -euo pipefail
download_only=false
if [ "${1:-}" = --download-only ]; then download_only=true; shift; fi
version="${1:?usage: $0 [--download-only] VERSION [PYTHON]}"
python="${2:-python3}"
cache="${XGEN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/xgen}"
gpu="${XGEN_LLAMA_GPU:-}"
gpu_archs="${XGEN_LLAMA_GPU_ARCHS:-}"
case "$gpu" in
  "") flavour=cpu ;;
  cuda|hip) flavour="$gpu"
    [ -n "$gpu_archs" ] || { echo "XGEN_LLAMA_GPU=$gpu needs XGEN_LLAMA_GPU_ARCHS (e.g. 80;86;89;90 or gfx90a;gfx942)" >&2; exit 2; } ;;
  *) echo "XGEN_LLAMA_GPU must be cuda or hip, not '$gpu'" >&2; exit 2 ;;
esac
prefix="$cache/llama.cpp/$version"
[ "$flavour" = cpu ] || prefix="$prefix-$flavour"
sdist_dir="$cache/sdist"
sdist="$sdist_dir/llama_cpp_python-$version.tar.gz"

state="$prefix.building"
failed="$prefix.failed"

# A GPU build's llama-server needs the driver's libcuda/libamdhip64 to start: only its files are checked.
runs() { if [ "$flavour" = cpu ]; then "$1/bin/llama-server" --version >/dev/null 2>&1; else [ -x "$1/bin/llama-server" ]; fi; }
if ! $download_only && [ -f "$prefix/build.json" ] && runs "$prefix"; then
  echo "llama.cpp $version: cached in $prefix"
  exit 0
fi

# One build at a time per version: a second run (another bootstrap) waits for the first one's result.
other="$(sed -n 's/.*"pid": \([0-9]*\).*/\1/p' "$state" 2>/dev/null || true)"
if ! $download_only && [ -n "$other" ] && grep -qa build_llama_cpp "/proc/$other/cmdline" 2>/dev/null; then
  echo "llama.cpp $version: another build runs (pid $other); waiting for it"
  while kill -0 "$other" 2>/dev/null; do sleep 2; done
  if [ -f "$prefix/build.json" ] && runs "$prefix"; then
    echo "llama.cpp $version: cached in $prefix"
    exit 0
  fi
fi

mkdir -p "$sdist_dir" "$cache/llama.cpp"
if [ ! -f "$sdist" ]; then
  echo "llama.cpp $version: downloading the llama-cpp-python $version source package"
  # --no-binary for this package only: its build requirements (scikit-build-core, for pip to read the
  # metadata) come as wheels, not compiled from source.
  "$python" -m pip download -q --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$version" -d "$sdist_dir.part" 2>&1 | grep -v "is ignored" || true
  mv "$sdist_dir.part/llama_cpp_python-$version.tar.gz" "$sdist"
  rm -rf "$sdist_dir.part"
fi
$download_only && exit 0

work="$(mktemp -d "$cache/llama.cpp/.build-$version.XXXXXX")"
# The console shows "llama.cpp building: N %" while $state names a live pid, and the error in
# $failed after a failed build (a console started before the build ended, deploy/bootstrap.sh run).
fail() {
  local error="$1" tail_file="${2:-}"
  echo "llama.cpp $version: $error" >&2
  [ -n "$tail_file" ] && tail -n 60 "$tail_file" >&2
  "$python" - "$failed" "$error" "${tail_file:-/dev/null}" <<'PY' || true
import json, sys, time
path, error, tail_file = sys.argv[1:4]
with open(tail_file, errors="replace") as f:
    tail = f.read()[-4000:]
with open(path + ".part", "w") as out:
    json.dump({"error": error, "tail": tail, "at": int(time.time())}, out)
import os; os.replace(path + ".part", path)
PY
  exit 1
}
trap 'rm -rf "$work" "$state"' EXIT
trap 'exit 130' INT TERM
tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -f "$src/tools/server/server.cpp" ] || [ ! -f "$src/LICENSE" ]; then
  fail "the source package has no vendor/llama.cpp/tools/server"
fi
commit="$(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown)"
started_at=$(date +%s)
# $1: llama.cpp's own version, once configured ("" before); $2: the phase (libraries: libllama and
# what it links, then llama-server); $3: the staged libraries' folder once they are there.
write_state() {
  printf '{"pid": %d, "version": "%s", "commit": "%s", "llama_version": "%s", "flavour": "%s", "started": %d, "log": "%s", "phase": "%s", "libs": "%s"}\n' \
    "$$" "$version" "$commit" "$1" "$flavour" "$started_at" "$work/build-$2.log" "$2" "${3:-}" >"$state.part"
  mv "$state.part" "$state"
}
write_state "" libraries

# Portable CPU build (GGML_NATIVE=OFF still enables AVX/AVX2/FMA/F16C on x86), shared libraries,
# only the server and what it links. No web UI, no HTTPS, nothing fetched while configuring.
flags=(
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=ON
  -DGGML_NATIVE=OFF
  -DLLAMA_BUILD_COMMON=ON
  -DLLAMA_BUILD_TOOLS=ON
  -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_APP=OFF
  -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_OPENSSL=OFF
  -DFETCHCONTENT_FULLY_DISCONNECTED=ON
  -DLLAMA_BUILD_NUMBER=0  # the sdist's vendored git has no history: say "unknown", not a wrong build number
  "-DLLAMA_BUILD_COMMIT=$commit"
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON
  '-DCMAKE_INSTALL_RPATH=$ORIGIN:$ORIGIN/../lib'
)
case "$flavour" in
  cuda) flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$gpu_archs") ;;
  hip) flags+=(-DGGML_HIP=ON "-DAMDGPU_TARGETS=$gpu_archs" "-DGPU_TARGETS=$gpu_archs")
    # llama.cpp's HIP build compiles with ROCm's clang (its docs: HIPCXX from hipconfig).
    export HIPCXX="${HIPCXX:-$(hipconfig -l)/clang}" HIP_PATH="${HIP_PATH:-$(hipconfig -R)}" ;;
esac
jobs="${XGEN_BUILD_JOBS:-$(nproc)}"
started=$(date +%s)
echo "llama.cpp $version ($commit, $flavour${gpu_archs:+ for $gpu_archs}): building llama-server and the shared libraries with $jobs jobs (minutes)"
cmake -S "$src" -B "$work/build" "${flags[@]}" >"$work/configure.log" 2>&1 \
  || fail "configuring the build failed" "$work/configure.log"
# llama.cpp's version as CMake states it ("0.5.0-dev"): with build 0 and the commit, what the
# built llama-server's --version will say, so a load planned meanwhile records the right one.
llama_version="$(sed -n 's/^-- llama.cpp version: \([A-Za-z0-9.+-]*\)$/\1/p' "$work/configure.log" | head -n 1)"
write_state "$llama_version" libraries
# First libllama and the ggml libraries it links (111 of 410 s on 2 cores): on a CPU build they are
# staged at once, so llama-cpp-python can serve while llama-server compiles (mtmd, common, the server).
cmake --build "$work/build" --target llama -j "$jobs" >"$work/build-libraries.log" 2>&1 \
  || fail "compiling libllama failed" "$work/build-libraries.log"
staged=""
if [ "$flavour" = cpu ]; then
  mkdir -p "$work/lib"
  cp -a "$work/build/bin/"lib*.so* "$work/lib/"
  printf '{"llama_cpp_python": "%s", "llama_cpp_commit": "%s", "flavour": "%s"}\n' "$version" "$commit" "$flavour" \
    >"$work/lib/lib.json"
  rm -rf "$prefix.lib"
  mv "$work/lib" "$prefix.lib"
  staged="$prefix.lib"
fi
write_state "$llama_version" llama-server "$staged"
cmake --build "$work/build" --target llama-server -j "$jobs" >"$work/build-llama-server.log" 2>&1 \
  || fail "compiling llama-server failed" "$work/build-llama-server.log"

out="$work/out"
mkdir -p "$out/bin" "$out/lib"
cp -a "$work/build/bin/llama-server" "$out/bin/"
cp -a "$work/build/bin/"lib*.so* "$out/lib/"
cp -a "$src/LICENSE" "$out/LICENSE"
runs "$out" || fail "the built llama-server does not run"
seconds=$(( $(date +%s) - started ))
printf '{"llama_cpp_python": "%s", "llama_cpp_commit": "%s", "flavour": "%s", "gpu_archs": "%s", "build_seconds": %d}\n' \
  "$version" "$commit" "$flavour" "$gpu_archs" "$seconds" >"$out/build.json"
rm -rf "$prefix" "$failed"
mv "$out" "$prefix"
echo "llama.cpp $version: built in ${seconds} s into $prefix"
