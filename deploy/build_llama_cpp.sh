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

# A GPU build's llama-server needs the driver's libcuda/libamdhip64 to start: only its files are checked.
runs() { if [ "$flavour" = cpu ]; then "$1/bin/llama-server" --version >/dev/null 2>&1; else [ -x "$1/bin/llama-server" ]; fi; }
if ! $download_only && [ -f "$prefix/build.json" ] && runs "$prefix"; then
  echo "llama.cpp $version: cached in $prefix"
  exit 0
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
trap 'rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -f "$src/tools/server/server.cpp" ] || [ ! -f "$src/LICENSE" ]; then
  echo "llama.cpp $version: the source package has no vendor/llama.cpp/tools/server" >&2
  exit 1
fi
commit="$(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown)"

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
cmake -S "$src" -B "$work/build" "${flags[@]}" >"$work/configure.log" 2>&1 || { cat "$work/configure.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j "$jobs" >"$work/build.log" 2>&1 \
  || { tail -n 60 "$work/build.log" >&2; exit 1; }

out="$work/out"
mkdir -p "$out/bin" "$out/lib"
cp -a "$work/build/bin/llama-server" "$out/bin/"
cp -a "$work/build/bin/"lib*.so* "$out/lib/"
cp -a "$src/LICENSE" "$out/LICENSE"
runs "$out" || { echo "llama.cpp $version: the built llama-server does not run" >&2; exit 1; }
seconds=$(( $(date +%s) - started ))
printf '{"llama_cpp_python": "%s", "llama_cpp_commit": "%s", "flavour": "%s", "gpu_archs": "%s", "build_seconds": %d}\n' \
  "$version" "$commit" "$flavour" "$gpu_archs" "$seconds" >"$out/build.json"
rm -rf "$prefix"
mv "$out" "$prefix"
echo "llama.cpp $version: built in ${seconds} s into $prefix"
