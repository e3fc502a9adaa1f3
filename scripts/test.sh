#!/usr/bin/env bash
# Build and run every test this machine can run, in one command:
#  1. the default build (CUDA kernels compiled when nvcc is present) and all its C++ tests
#     (CUDA tests skip themselves with a message when no GPU is present);
#  2. the CPU tests again under AddressSanitizer + UndefinedBehaviorSanitizer;
#  3. on a CPU with AVX512-BF16 but no AMX: the cpu_flash tests again with the AMX forward and
#     backward running on a software model of the tile unit (FLASHCORE_AMX_EMULATION), so that the
#     AMX paths, which only run natively on Sapphire Rapids and later, are checked on every machine
#     that can;
#  4. on a CPU with AVX-512: the CPU tests again on the AVX2 + FMA layer of the kernels (a build for
#     -mavx2 -mfma instead of -march=native), the layer that CPUs without AVX-512 run;
#  5. the Python package (pip install .) and its pytest suite.
# Set SKIP_SANITIZE=1, SKIP_AMX_MODEL=1, SKIP_AVX2=1 or SKIP_PYTHON=1 to leave a stage out while
# iterating.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
step() { printf '\n==== %s ====\n' "$*"; }

step "build (default configuration)"
cmake -S . -B build "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-}
time cmake --build build -j "$JOBS"
step "C++ tests"
ctest --test-dir build --output-on-failure -j "$JOBS"

if [ "${SKIP_SANITIZE:-0}" != 1 ]; then
  step "CPU tests under ASan + UBSan"
  cmake -S . -B build-asan "${GEN[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLASHCORE_SANITIZE=ON -DFLASHCORE_CUDA=OFF
  cmake --build build-asan -j "$JOBS"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j "$JOBS" -L cpu
fi

if [ "${SKIP_AMX_MODEL:-0}" != 1 ] && grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null &&
   ! grep -qw amx_bf16 /proc/cpuinfo; then
  step "cpu_flash tests with the AMX forward and backward on a software tile model"
  cmake -S . -B build-amx-model "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DFLASHCORE_CUDA=OFF \
    -DFLASHCORE_AMX_EMULATION=ON -DFLASHCORE_BUILD_CLI=OFF
  cmake --build build-amx-model -j "$JOBS" --target flashcore_cpu_tests
  build-amx-model/tests/flashcore_cpu_tests --gtest_filter='CpuFlash*' --gtest_brief=1
fi

if [ "${SKIP_AVX2:-0}" != 1 ] && grep -qw avx512f /proc/cpuinfo 2>/dev/null &&
   grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
  step "CPU tests on the AVX2 + FMA layer"
  cmake -S . -B build-avx2 "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DFLASHCORE_CUDA=OFF -DFLASHCORE_NATIVE=OFF \
    -DFLASHCORE_BUILD_CLI=OFF -DFLASHCORE_BUILD_PYTHON=OFF "-DCMAKE_CXX_FLAGS=-mavx2 -mfma -mf16c"
  cmake --build build-avx2 -j "$JOBS" --target flashcore_cpu_tests
  ctest --test-dir build-avx2 --output-on-failure -j "$JOBS" -L cpu
fi

if [ "${SKIP_PYTHON:-0}" != 1 ] && [ -f pyproject.toml ]; then
  step "Python package and tests"
  # Without a GPU the package is built CPU-only: the CUDA kernels were already compile-checked above.
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then export FLASHCORE_CUDA=${FLASHCORE_CUDA:-OFF}; fi
  CMAKE_BUILD_PARALLEL_LEVEL=$JOBS python3 -m pip install ${PIP_FLAGS:-} -q .
  python3 -m pytest -q tests/python
fi
step "all tests passed"
