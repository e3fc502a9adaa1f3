#!/usr/bin/env bash
# The CPU path on this machine, in one call (meant for the GPU machine's Xeon, where #2's 1.25x
# over torch's CPU SDPA is short): the CPU model, its fp32 FMA ceiling (dev/fma_peak.cpp), the
# forward in every tile configuration of dev/cpu_forward_sweep.cpp, and, where torch is
# installed, bench/peers.py's CPU section against torch's CPU SDPA with a CPU-only build of the
# Python package. Needs no GPU and no network. Output in OUTDIR; a summary prints last.
# Also the forward's two GEMMs alone per micro-tile (dev/cpu_gemm_rate.cpp) at 1 and the given
# thread counts. The sweep takes ROUNDS, SHAPES and ONLY from the environment.
#
# usage: dev/cpu_tune.sh OUTDIR [THREADS ...]     (default threads: 2 16)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: dev/cpu_tune.sh OUTDIR [THREADS ...]}
shift
THREADS=("$@")
[ ${#THREADS[@]} -eq 0 ] && THREADS=(2 16)
mkdir -p "$OUT"
JOBS=$(nproc)
BIN=$(mktemp -d)

{ lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|L1d|L2|L3|Flags" | sed 's/Flags:.*avx512/Flags: ... avx512/' | cut -c1-160; } >"$OUT/cpu.txt"

g++ -std=c++17 -O2 -march=native -fopenmp dev/fma_peak.cpp -o "$BIN/fma_peak" &
AMX_FLAGS=$(grep -qw amx_bf16 /proc/cpuinfo && echo "-mamx-tile -mamx-bf16")
g++ -std=c++17 -O3 -march=native $AMX_FLAGS -pthread -I include -I src dev/cpu_forward_sweep.cpp src/cpu/worker_pool.cpp \
  src/cpu/amx_forward.cpp -o "$BIN/cpu_forward_sweep" &
g++ -std=c++17 -O3 -march=native -pthread -I include -I src dev/cpu_gemm_rate.cpp -o "$BIN/cpu_gemm_rate" &
wait
"$BIN/fma_peak" 1 "${THREADS[@]}" >"$OUT/fma_peak.txt" 2>&1
"$BIN/cpu_gemm_rate" 1 "${THREADS[@]}" >"$OUT/gemm_rate.txt" 2>&1
"$BIN/cpu_forward_sweep" "${THREADS[@]}" >"$OUT/sweep.txt" 2>&1

PY=${PYTHON:-python3}  # the interpreter with torch (the build itself uses python3 for nanobind)
if "$PY" -c "import torch" 2>/dev/null; then
  cmake -S . -B "$BIN/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHCORE_CUDA=OFF -DFLASHCORE_BUILD_PYTHON=ON \
    >"$OUT/peers_build.log" 2>&1 && cmake --build "$BIN/build" -j "$JOBS" >>"$OUT/peers_build.log" 2>&1
  PKG="$BIN/pkg"
  mkdir -p "$PKG" && cp -r python/flashcore "$PKG/" && cp "$BIN"/build/python/_C*.so "$PKG/flashcore/" 2>/dev/null
  (IFS=,; OMP_WAIT_POLICY=passive PYTHONPATH="$PKG" "$PY" bench/peers.py "$OUT/peers" --cpu-only \
     --threads "${THREADS[*]}") >"$OUT/peers.txt" 2>&1
fi

{
  echo "== $(grep 'Model name' "$OUT/cpu.txt" | sed 's/ \+/ /g')"
  cat "$OUT/fma_peak.txt" "$OUT/gemm_rate.txt"
  grep -E "threads,|shipped|x$|WRONG|[0-9]x  max" "$OUT/sweep.txt" | sed -n '1,200p'
  [ -f "$OUT/peers.txt" ] && grep -E "^cpu " "$OUT/peers.txt"
} | tee "$OUT/summary.txt"
rm -rf "$BIN"
