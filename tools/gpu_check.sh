#!/usr/bin/env bash
# The GPU check: on a GPU machine without network, build te_jax with its CUDA
# handlers, run the test suite on the GPU (kernels vs the CPU-evaluated
# reference, bit for bit), run the benchmarks, and write under $OUT:
#   build.log, tests.log, summary.json, summary.md
# Usage: OUT=/some/dir bash tools/gpu_check.sh [--skip-build] [--only-bench] [pytest -k expression]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=python3
skip_build=0; only_bench=0; kexpr=""
for arg in "$@"; do
  case "$arg" in
    --skip-build) skip_build=1 ;;
    --only-bench) only_bench=1 ;;
    *) kexpr="$arg" ;;
  esac
done

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv; \
  $PY -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$OUT/tests.log" 2>&1

if [ $skip_build -eq 0 ]; then
  start=$(date +%s)
  if ! $PY -m pip install --no-build-isolation --no-deps -v . \
      -C cmake.define.TE_JAX_CUDA=ON -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a > "$OUT/build.log" 2>&1; then
    echo "gpu_check: BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1
  fi
  echo "gpu_check: built in $(( $(date +%s) - start )) s"
fi
$PY -c "import te_jax, te_jax._ffi as f; assert f.CUDA_BUILT, 'CUDA handlers missing'; print('te_jax CUDA handlers:', f.TARGETS)" \
  >> "$OUT/tests.log" 2>&1 || { echo "gpu_check: te_jax import failed"; tail -20 "$OUT/tests.log"; exit 1; }

if [ $only_bench -eq 0 ]; then
  args=(-q -p no:cacheprovider --junitxml="$OUT/junit.xml" -x --maxfail=20)
  [ -n "$kexpr" ] && args+=(-k "$kexpr")
  $PY -m pytest "${args[@]}" tests/ >> "$OUT/tests.log" 2>&1
  echo "gpu_check: pytest exit $?"
  tail -5 "$OUT/tests.log"
fi

for bench in benchmarks/bench_*.py; do
  name=$(basename "$bench" .py)
  $PY "$bench" --out "$OUT/$name.json" --md "$OUT/$name.md" >> "$OUT/tests.log" 2>&1 \
    || echo "gpu_check: $name failed (see tests.log)"
done
$PY tools/gpu_summary.py "$OUT"
rm -f "$OUT"/bench_*.json "$OUT"/bench_*.md "$OUT/junit.xml"
