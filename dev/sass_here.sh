#!/usr/bin/env bash
# The SASS of one generated CUDA unit, on the development machine (no GPU needed): compiles the
# unit to a cubin with ptxas's register / spill report and disassembles it, so instruction
# choices can be read before a device call. Session 57 found this way that a fence after the sm80
# backward's dQ reductions had turned them from REDG into returning ATOMG (docs/PERF.md).
#
# usage: dev/sass_here.sh UNIT [ARCH] [-- EXTRA_NVCC_FLAGS...]
#   UNIT  a generated unit, e.g. sm80_backward_bf16_hdim128 or sm90_forward_bf16_hdim64 (the list:
#         ls $BUILD/generated/cuda after the first run)
#   ARCH  sm_90 (default; sm90 units need sm_90a) or sm_80
# env: BUILD (default build-sass: a CMake build dir used only for its generated units and compile
#      commands), DTYPES (bf16), TOOLS (where cuobjdump and nvdisasm come from when they are not on
#      PATH: the nvidia-cuda-cuobjdump / -nvdisasm pip wheels, fetched once; ~/.cache/flashcore-sass).
# Writes $BUILD/sass/UNIT.{cubin,log,sass}; prints ptxas's spills per kernel (scripts/spill_report.py),
# per kernel the counts of the instructions that usually matter here (stg16 / stg4: 16-byte and
# 4-byte global stores; ptxas has split uint4 stores into four 4-byte ones twice, sessions 53
# and 58), and where the local-memory instructions sit (dev/sass_spills.py: inside the loops or
# not).
set -euo pipefail
cd "$(dirname "$0")/.."
UNIT=${1:?usage: dev/sass_here.sh UNIT [ARCH] [-- EXTRA_NVCC_FLAGS...]}
shift
ARCH=sm_90
if [ $# -gt 0 ] && [ "$1" != -- ]; then ARCH=$1; shift; fi
[ "${1:-}" = -- ] && shift
BUILD=${BUILD:-build-sass}
TOOLS=${TOOLS:-$HOME/.cache/flashcore-sass}

CUOBJDUMP=$(command -v cuobjdump || true)
if [ -z "$CUOBJDUMP" ]; then
  CUOBJDUMP=$(find "$TOOLS" -name cuobjdump -type f 2>/dev/null | head -1 || true)
  if [ -z "$CUOBJDUMP" ]; then
    mkdir -p "$TOOLS"
    python3 -m pip download --no-deps -q -d "$TOOLS" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
    for wheel in "$TOOLS"/*.whl; do python3 -m zipfile -e "$wheel" "$TOOLS/x"; done
    CUOBJDUMP=$(find "$TOOLS" -name cuobjdump -type f | head -1)
    chmod +x "$(dirname "$CUOBJDUMP")"/*
  fi
  export PATH="$(dirname "$CUOBJDUMP"):$PATH"  # cuobjdump -sass runs nvdisasm from the same wheel set
fi

if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHCORE_CUDA=ON -DFLASHCORE_CUDA_ARCHS=90 \
    -DFLASHCORE_DTYPES="${DTYPES:-bf16}" -DFLASHCORE_BUILD_TESTS=OFF -DFLASHCORE_BUILD_PYTHON=OFF >/dev/null
fi
# The unit's compile command as the build runs it, made into a one-architecture cubin build.
CMD=$(ninja -C "$BUILD" -t commands | grep -F "generated/cuda/$UNIT.cu -o" | head -1)
[ -n "$CMD" ] || { echo "no unit $UNIT in $BUILD/generated/cuda"; exit 2; }
read -ra WORDS <<<"$CMD"
ARGS=()
for ((i = 1; i < ${#WORDS[@]}; ++i)); do
  case "${WORDS[i]}" in
    -c | -MD) ;;
    -MT | -MF | -o) ((++i)) ;;
    --generate-code=*) ;;
    *) ARGS+=("${WORDS[i]}") ;;
  esac
done
mkdir -p "$BUILD/sass"
OUT="$BUILD/sass/$UNIT"
"${WORDS[0]}" "${ARGS[@]//\\\"/\"}" -arch="$ARCH" -cubin -Xptxas=-v "$@" -o "$OUT.cubin" >"$OUT.log" 2>&1 \
  || { tail -20 "$OUT.log"; exit 1; }
"$CUOBJDUMP" -sass "$OUT.cubin" >"$OUT.sass"
python3 scripts/spill_report.py "$OUT.log" | head -20
echo "instructions per kernel ($OUT.sass):"
awk '
  /Function :/ { name = $3; order[++n] = name }
  /^ +\/\*[0-9a-f]+\*\// {
    total[name]++
    if ($0 ~ /HMMA|HGMMA/) mma[name]++
    if ($0 ~ /LDSM/) ldsm[name]++
    if ($0 ~ /REDG|RED\.E/) red[name]++
    if ($0 ~ /ATOMG/) atom[name]++
    if ($0 ~ /STL|LDL/) local[name]++
    if ($0 ~ /BAR\.SYNC/) bar[name]++
    if ($0 ~ /MEMBAR/) membar[name]++
    if ($0 ~ /STG\.E\.128/) stg16[name]++
    else if ($0 ~ /STG\.E[ .]/ && $0 !~ /STG\.E\.(64|U8|S8|U16|S16)/) stg4[name]++
  }
  END {
    printf "%7s %6s %5s %5s %5s %5s %4s %6s %5s %4s  %s\n", "instr", "mma", "ldsm", "red", "atomg", "local", "bar", "membar", "stg16", "stg4", "kernel"
    for (i = 1; i <= n; ++i) {
      k = order[i]
      printf "%7d %6d %5d %5d %5d %5d %4d %6d %5d %4d  %s\n", total[k], mma[k], ldsm[k], red[k], atom[k], local[k], bar[k], membar[k], stg16[k], stg4[k], k
    }
  }' "$OUT.sass" | { command -v c++filt >/dev/null && c++filt || cat; } | cut -c1-220
python3 dev/sass_spills.py "$OUT.sass"
