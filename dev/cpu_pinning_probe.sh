#!/bin/bash
# Whether where the OS puts two threads moves the 2-thread CPU numbers (#2's cells): the CPU's
# topology, then dev/fma_peak, dev/cpu_gemm_rate and bench/peers.py's CPU forward / decode section
# (flashcore against torch's CPU SDPA, same process), run free, pinned to two distinct physical
# cores (taskset), and pinned to two hyperthread siblings where the CPU has them. Needs torch, no
# GPU and no network; ~1 min on the GPU machine's 16 cores. Summary in OUTDIR/summary.txt.
# usage: dev/cpu_pinning_probe.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
O=${1:?usage: dev/cpu_pinning_probe.sh OUTDIR}
mkdir -p "$O"
lscpu >"$O/lscpu.txt"
lscpu -e >"$O/lscpu_e.txt"
# The first two CPUs on distinct cores, and the first pair of siblings (none without SMT).
read -r A B <<<"$(awk 'NR > 1 && !($4 in seen) { seen[$4] = 1; if (n++ < 2) printf "%s ", $1 }' "$O/lscpu_e.txt")"
SIB=$(awk 'NR > 1 { c[$4] = c[$4] " " $1 } END { for (k in c) { n = split(c[k], a, " "); if (n >= 2) { print a[1] "," a[2]; exit } } }' "$O/lscpu_e.txt")
BIN=$(mktemp -d)
g++ -std=c++17 -O2 -march=native -fopenmp dev/fma_peak.cpp -o "$BIN/fma_peak" &
g++ -std=c++17 -O3 -march=native -pthread -I include -I src dev/cpu_gemm_rate.cpp -o "$BIN/cpu_gemm_rate" &
cmake -S . -B "$BIN/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHCORE_CUDA=OFF -DFLASHCORE_BUILD_PYTHON=ON \
  -DFLASHCORE_BUILD_TESTS=OFF >"$O/build.log" 2>&1 && cmake --build "$BIN/build" -j "$(nproc)" >>"$O/build.log" 2>&1
wait
PKG="$BIN/pkg"
mkdir -p "$PKG" && cp -r python/flashcore "$PKG/" && cp "$BIN"/build/python/_C*.so "$PKG/flashcore/"
{
  echo "== $(grep 'Model name' "$O/lscpu.txt" | sed 's/ \+/ /g'); distinct cores: $A,$B; siblings: ${SIB:-none}"
  for mode in free pinned siblings; do
    case $mode in free) T=() ;; pinned) T=(taskset -c "$A,$B") ;; siblings) T=(taskset -c "$SIB") ;; esac
    [ "$mode" = siblings ] && [ -z "$SIB" ] && continue
    echo "== $mode ${T[*]}"
    "${T[@]}" "$BIN/fma_peak" 1 2 2>&1 | tail -2
    "${T[@]}" "$BIN/cpu_gemm_rate" 1 2 2>&1 | tail -6
    OMP_WAIT_POLICY=passive PYTHONPATH="$PKG" "${T[@]}" python3 bench/peers.py "$O/peers_$mode" --cpu-only \
      --threads 2 --no-backward 2>&1 | grep -E "^cpu "
  done
} 2>&1 | tee "$O/summary.txt"
rm -rf "$BIN"
