#!/usr/bin/env bash
# The GPU check: on a GPU machine without network, build te_jax with its CUDA
# handlers, run the test suite on the GPU (kernels vs the CPU-evaluated
# reference, bit for bit), run the benchmarks, and write under $OUT:
#   build.log, tests.log, summary.json, summary.md (and multi_gpu.log with --multi-gpu)
# Usage: OUT=/some/dir bash tools/gpu_check.sh [--skip-build] [--no-tests] [--no-bench]
#        [--bench=quantize,gemm,inspect] [--multi-gpu] [pytest arguments: test files, -k ...]
#        (default: all of tests/)
# --multi-gpu (2 or more GPUs): the layer mesh checks of tests/mesh_multidevice.py (dp and tp over
# two GPUs against one, NCCL collectives) and the data-parallel scaling of the 125m GPT (tokens/s on
# one GPU at batch 32 against all GPUs at 32 per GPU), as JSON lines in multi_gpu.log.
# --train=bf16,delayed,...: examples/gpt with each recipe (TRAIN_PRESET, default 125m; TRAIN_STEPS,
# default the preset's), one run per GPU at a time; a JSON line per run in train.log (final train and
# eval loss, tokens/s). "flax-fp8" is the same model through flax.linen's Fp8DotGeneral.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=python3
skip_build=0; run_tests=1; run_bench=1; multi_gpu=0; benches=""; train=""; pytest_args=()
for arg in "$@"; do
  case "$arg" in
    --skip-build) skip_build=1 ;;
    --no-tests) run_tests=0 ;;
    --no-bench) run_bench=0 ;;
    --bench=*) benches=${arg#--bench=} ;;
    --multi-gpu) multi_gpu=1 ;;
    --train=*) train=${arg#--train=} ;;
    *) pytest_args+=("$arg") ;;
  esac
done
[ ${#pytest_args[@]} -eq 0 ] && pytest_args=(tests/)
# Python runs outside the source tree so that it imports the installed te_jax
# (with its compiled modules), not the te_jax/ folder beside it.
pytest_args=("${pytest_args[@]/#tests\//}")

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
(cd /tmp && $PY -c "import te_jax, te_jax._ffi as f; assert f.CUDA_BUILT, 'CUDA handlers missing'; print('te_jax CUDA handlers:', f.TARGETS)") \
  >> "$OUT/tests.log" 2>&1 || { echo "gpu_check: te_jax import failed"; tail -20 "$OUT/tests.log"; exit 1; }

if [ $run_tests -eq 1 ]; then
  start=$(date +%s)
  (cd "$ROOT/tests" && XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -m pytest -q -p no:cacheprovider --junitxml="$OUT/junit.xml" --maxfail=30 -n 8 "${pytest_args[@]}") \
    >> "$OUT/tests.log" 2>&1
  echo "gpu_check: pytest exit $? in $(( $(date +%s) - start )) s"
  tail -5 "$OUT/tests.log"
fi

if [ $run_bench -eq 1 ]; then
  for bench in benchmarks/bench_*.py; do
    name=$(basename "$bench" .py)
    if [ -n "$benches" ] && [[ ",$benches," != *",${name#bench_},"* ]]; then continue; fi
    start=$(date +%s)
    (cd /tmp && $PY "$ROOT/$bench" --out "$OUT/$name.json" --md "$OUT/$name.md") >> "$OUT/tests.log" 2>&1 \
      || echo "gpu_check: $name failed (see tests.log)"
    echo "gpu_check: $name took $(( $(date +%s) - start )) s"
  done
fi
if [ $multi_gpu -eq 1 ]; then
  n=$(cd /tmp && $PY -c "import jax; print(jax.device_count())")
  log="$OUT/multi_gpu.log"
  echo "{\"gpus\": $n}" > "$log"
  if [ "$n" -ge 2 ]; then
    start=$(date +%s)
    (cd "$ROOT/tests" && $PY mesh_multidevice.py --models mlp,stack --meshes dp2,tp2 \
      --recipes delayed,current,delayed_split,current_split) \
      2>/dev/null | grep '^{' >> "$log"
    echo "gpu_check: mesh checks took $(( $(date +%s) - start )) s"
    for run in "1 32 dp=1" "$n $((32 * n)) dp=$n"; do
      set -- $run
      (cd /tmp && CUDA_VISIBLE_DEVICES=$(seq -s, 0 $(($1 - 1))) $PY "$ROOT/examples/gpt/train.py" --preset 125m \
        --recipe delayed --steps 40 --batch "$2" --mesh "$3" --eval-every 1000 --eval-batches 1 --no-progress \
        --log-every 20 --json /tmp/scale.json > /tmp/scale.log 2>&1) || tail -20 /tmp/scale.log
      $PY -c "import json; r = json.load(open('/tmp/scale.json'))[0]; print(json.dumps({'scaling': '$3', 'gpus': $1, \
'batch': $2, 'tokens_per_s': r['tokens_per_s'], 'final_train_loss': r['final_train_loss']}))" >> "$log"
    done
    grep -h scaling "$log"
  fi
fi
if [ -n "$train" ]; then
  n=$(cd /tmp && $PY -c "import jax; print(jax.device_count())")
  IFS=, read -ra recipes <<< "$train"
  steps=()
  [ -n "${TRAIN_STEPS:-}" ] && steps=(--steps "$TRAIN_STEPS")
  i=0
  for r in "${recipes[@]}"; do
    (cd /tmp && CUDA_VISIBLE_DEVICES=$((i % n)) $PY "$ROOT/examples/gpt/train.py" --preset "${TRAIN_PRESET:-125m}" \
       --recipe "$r" "${steps[@]}" --no-progress --log-every 100 --json "/tmp/train_$i.json" > "/tmp/train_$i.log" 2>&1 \
     && $PY -c "import json; r = json.load(open('/tmp/train_$i.json'))[0]; print(json.dumps({k: r[k] for k in \
('recipe', 'preset', 'steps', 'final_train_loss', 'final_eval_loss', 'tokens_per_s')}))" >> "$OUT/train.log" \
     || { echo "gpu_check: training $r failed"; tail -5 "/tmp/train_$i.log"; }) &
    i=$((i + 1))
    [ $((i % n)) -eq 0 ] && wait
  done
  wait
  cat "$OUT/train.log"
fi
$PY "$ROOT/tools/gpu_summary.py" "$OUT"
rm -f "$OUT"/bench_*.json "$OUT"/bench_*.md "$OUT/junit.xml"
