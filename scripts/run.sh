#!/usr/bin/env bash
# The main job in one command: build flashcore (CUDA kernels too when nvcc is present) and run
# `flashcore run` - attention on the best backend present (a GPU when one is usable, else the
# CPU flash path), checked against the fp64 reference. Extra arguments go to `flashcore run`.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
BUILD=${BUILD_DIR:-build}
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DFLASHCORE_BUILD_TESTS=OFF ${CMAKE_ARGS:-}
fi
cmake --build "$BUILD" -j "$JOBS" --target flashcore_cli
exec "$BUILD/flashcore" run "$@"
