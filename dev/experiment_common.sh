# Shared by the one-call device experiments (sm90_fwd_experiment.sh, seed_experiment.sh); sourced,
# not run. experiment_start OUTDIR: the summary file, note (echo + append to it), el (seconds
# since the start) and the device line. build_package BUILD_DIR PKG_DIR [CMAKE_ARGS...]: a
# Release sm_90 build of the Python package with -Xptxas=-v (registers / spills in build.log), no
# CLI, plus the given options; copies the package to PKG_DIR and puts it on PYTHONPATH; stops the
# experiment on a build failure.

experiment_start() {
  mkdir -p "$1"
  SUM="$1/summary.txt"; : >"$SUM"
  BUILD_LOG="$1/build.log"
  T0=$(date +%s)
  note "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
}
note() { echo "$*" | tee -a "$SUM"; }
el() { echo $(( $(date +%s) - T0 ))s; }

build_package() {
  local build_dir=$1 pkg_dir=$2; shift 2
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHCORE_CUDA=ON -DFLASHCORE_CUDA_ARCHS=90 \
    -DFLASHCORE_BUILD_CLI=OFF -DFLASHCORE_BUILD_PYTHON=ON -DCMAKE_CUDA_FLAGS="-Xptxas=-v" "$@" >"$BUILD_LOG" 2>&1
  if ! cmake --build "$build_dir" -j 16 >>"$BUILD_LOG" 2>&1; then
    note "BUILD FAILED ($(el))"; grep -E "error" "$BUILD_LOG" | head -20 | tee -a "$SUM"; exit 1
  fi
  note "build ok ($(el)); kernels with spills: $(grep -E '[1-9][0-9]* bytes spill stores' "$BUILD_LOG" | wc -l)"
  rm -rf "$pkg_dir" && mkdir -p "$pkg_dir/flashcore" && cp python/flashcore/*.py "$pkg_dir/flashcore/" \
    && cp "$build_dir"/python/_C*.so "$pkg_dir/flashcore/"
  export PYTHONPATH=$pkg_dir
}
