#!/usr/bin/env bash
# The GPU check: on a GPU machine without network, build te_jax with its CUDA handlers (or install
# a wheel an earlier run built), then run its jobs on the machine's GPUs in parallel, within a
# deadline (tools/gpu_jobs.py): the test suite (kernels vs the CPU-evaluated reference, bit for
# bit), the benchmarks, the multi-GPU checks and training runs. Writes under $OUT:
#   summary.md, summary.json   the tables (tests, benchmarks, training, multi-GPU, jobs)
#   jobs.log                   one JSON line per job: GPUs, exit status, seconds (log tail on failure)
#   logs.tgz                   build.log, every job's full output, train.log, multi_gpu.log
#   te_jax-*.whl               the wheel built here (pass it back with --wheel= to skip the build)
#
# Usage: OUT=/some/dir bash tools/gpu_check.sh [--skip-build | --wheel=FILE] [--no-tests]
#        [--no-bench | --bench=quantize,gemm,...] [--multi-gpu] [--train=RUN,...] [--deadline=S]
#        [pytest arguments: test files, -k ...] (default: all of tests/)
# Jobs start in this order: the tests (or where --tests stands), then --bench/--multi-gpu/--train in
# the order given (all the benchmarks last when --bench is not given). Each takes one GPU except the multi-GPU ones.
# --bench=NAME,...  benchmarks/bench_NAME.py; extra arguments from $BENCH_<NAME>_ARGS
#                   (e.g. BENCH_LAYERS_ARGS="--sections mlp --trials 3"). NAME@base runs it again with
#                   the CUDA module (kernels) of the wheel $WHEEL_BASE (or $BASELINE_WHEEL; a path from the
#                   repository root), for a before/after in one call; NAME@TAG does the same with the wheel
#                   $WHEEL_<TAG>, and takes its arguments from $BENCH_<NAME>_<TAG>_ARGS when that is set.
# --multi-gpu[=mesh,scaling]  (2 or more GPUs; default both) "mesh": the layer mesh checks of
#                   tests/mesh_multidevice.py, dp and tp over two GPUs against one, NCCL collectives
#                   (models from $MESH_MODELS, meshes from $MESH_MESHES, recipes from $MESH_RECIPES;
#                   MESH_NOISE_FLOOR=1 adds --noise-floor, MESH_BACKEND=reference runs the pure-JAX twins;
#                   the job fails unless every case is exact or within its noise floor); "scaling": the data-parallel scaling of the 125m GPT
#                   (tokens/s on one GPU at batch 32 against all of them at 32 per GPU).
# --train=RUN,...   examples/gpt, one run per GPU at a time. RUN is RECIPE[@PRESET[:STEPS]]
#                   (default preset $TRAIN_PRESET or 125m, steps $TRAIN_STEPS or the preset's);
#                   "flax-fp8" is the same model through flax.linen's Fp8DotGeneral; RECIPE+inspect
#                   adds --inspect (statistics at each evaluation step), RECIPE+inspectK also
#                   --inspect-every K (every K-th row).
# --lt-probe=M,N,K[,SCALES]  tools/lt_probe.cu: every cuBLASLt candidate of the per-tensor FP8 GEMM, te_jax's
#                   and XLA's descriptors, with and without workspace, timed in turns at the power cap;
#                   SCALES 1dx2d, 2dx1d or 1dx1d probes the Float8 block-scaled GEMM instead. Each
#                   probe is one job on one GPU; $LT_PROBE_ARGS adds flags (e.g. "--exhaustive 12").
# --deadline=S      every job ends within S seconds of the script's start (default 570).
#                   Time estimates that decide what still starts: $TESTS_EST_S, $BENCH_EST_S (default 120),
#                   $LT_PROBE_EST_S (default 150).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
LOGS=/tmp/gpu_check_logs
rm -rf "$LOGS" && mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 ROOT OUT LOGS PY=python3
script_start=$(date +%s)
build=1; wheel=""; run_tests=1; run_bench=1; bench_given=0; deadline=570; jobs=(); pytest_args=()

# ---- the jobs: each runs from /tmp, so Python imports the installed te_jax (with its compiled
# modules), not the te_jax/ folder in the source tree.
tests_job() {
  cd "$ROOT/tests" && XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -m pytest -q -p no:cacheprovider \
    --junitxml="$OUT/junit.xml" --maxfail=30 -n 8 "$@"
}
bench_job() {  # NAME, or NAME@TAG: the same benchmark with the CUDA module of another wheel
  local name=${1%@*} var args=() tag=$1 pypath=${PYTHONPATH:-}
  var="BENCH_${name^^}_ARGS"
  local tag_var="BENCH_${name^^}_${1##*@}_ARGS"
  tag_var=${tag_var^^}
  [[ $1 == *@* && -n ${!tag_var:-} ]] && var=$tag_var
  eval "args=(${!var:-})"
  if [[ $1 == *@* ]]; then
    local wheel_tag=${1##*@} wheel_var
    wheel_var=WHEEL_${wheel_tag^^}
    [[ $wheel_tag == base && -z ${!wheel_var:-} ]] && wheel_var=BASELINE_WHEEL  # the older name of WHEEL_BASE
    [ -n "${!wheel_var:-}" ] || { echo "bench $1: set WHEEL_${wheel_tag^^} (a path from the repository root)"; return 1; }
    tag=${name}_$wheel_tag
    local base=/tmp/te_base_$GPU_JOB site wheel_path=${!wheel_var}
    [[ $wheel_path == /* ]] || wheel_path=$ROOT/$wheel_path
    site=$(cd /tmp && $PY -c "import te_jax, os; print(os.path.dirname(os.path.dirname(te_jax.__file__)))")
    rm -rf "$base" && mkdir -p "$base" && cp -r "$site/te_jax" "$base/" || return 1
    rm -f "$base"/te_jax/_te_jax_cuda*  # the baseline's module replaces the built one, whatever its file name
    $PY -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
m = [n for n in z.namelist() if n.startswith('te_jax/_te_jax_cuda')]; \
sys.exit(f'{sys.argv[1]}: expected one CUDA module, found {m}') if len(m) != 1 else z.extractall(sys.argv[2], m); \
print('bench with the CUDA module', m[0], 'of', sys.argv[1])" "$wheel_path" "$base" || return 1
    pypath=$base${pypath:+:$pypath}
  fi
  local job=${GPU_JOB:-bench_$1}
  tag+=${job#"bench_$1"}  # "_2", "_3" for a benchmark listed again (see the job list below)
  cd /tmp && PYTHONPATH=$pypath $PY "$ROOT/benchmarks/bench_$name.py" --out "$OUT/bench_$tag.json" \
    --md "$OUT/bench_$tag.md" "${args[@]}"
}
train_job() {  # recipe[+inspect[K]] preset [steps]
  local json="/tmp/train_$GPU_JOB.json" extra=() recipe=${1%%+inspect*} every
  [ -n "${3:-}" ] && extra=(--steps "$3")
  if [[ $1 == *+inspect* ]]; then
    every=${1##*+inspect}
    extra+=(--inspect "/tmp/inspect_$GPU_JOB")
    [ -n "$every" ] && extra+=(--inspect-every "$every")
  fi
  cd /tmp && $PY "$ROOT/examples/gpt/train.py" --preset "$2" --recipe "$recipe" "${extra[@]}" --no-progress \
    --log-every 100 --json "$json" || return 1
  $PY -c "import json, sys; r = json.load(open('$json'))[0]; print(json.dumps({k: r[k] for k in \
('recipe', 'preset', 'steps', 'final_train_loss', 'final_eval_loss', 'tokens_per_s')} | {'run': sys.argv[2], \
'gpu': sys.argv[1], 'window_tokens_per_s': [round(v) for v in r['history']['window_tokens_per_s']]} | \
{k: v for k, v in (r.get('inspect') or {}).items() if k in ('step_ms', 'inspect_step_ms', 'overhead')}))" \
  "$CUDA_VISIBLE_DEVICES" "$1" >> "$OUT/train.log"
}
mesh_job() {
  set -o pipefail  # the job's status is the check's, not tee's or grep's
  cd "$ROOT/tests" && $PY mesh_multidevice.py --models "${MESH_MODELS:-mlp,stack}" --meshes "${MESH_MESHES:-dp2,tp2}" \
    --recipes "${MESH_RECIPES:-delayed,current,delayed_split,current_split}" --check ${MESH_NOISE_FLOOR:+--noise-floor} \
    ${MESH_BACKEND:+--backend "$MESH_BACKEND"} | tee /dev/stderr | grep '^{' >> "$OUT/multi_gpu.log"
}
scaling_job() {  # the 125m GPT on the first GPU at batch 32, then on all of them at 32 per GPU
  local n all=$CUDA_VISIBLE_DEVICES
  n=$(tr ',' '\n' <<< "$all" | wc -l)
  for run in "${all%%,*} 1" "$all $n"; do
    set -- $run
    (cd /tmp && CUDA_VISIBLE_DEVICES=$1 $PY "$ROOT/examples/gpt/train.py" --preset 125m --recipe delayed \
      --steps 40 --batch $((32 * $2)) --mesh "dp=$2" --eval-every 1000 --eval-batches 1 --no-progress \
      --log-every 20 --json /tmp/scale.json) || return 1
    $PY -c "import json; r = json.load(open('/tmp/scale.json'))[0]; print(json.dumps({'scaling': 'dp=$2', \
'gpus': $2, 'batch': $((32 * $2)), 'tokens_per_s': r['tokens_per_s'], 'final_train_loss': r['final_train_loss']}))" \
      >> "$OUT/multi_gpu.log"
  done
}
lt_probe_job() {  # M N K [SCALES]: tools/lt_probe.cu against the cuBLASLt that te_jax's CUDA module loads
  local so lib exe=/tmp/lt_probe_$GPU_JOB
  so=$(cd /tmp && $PY -c "import glob, os, te_jax; print(glob.glob(os.path.join(os.path.dirname(te_jax.__file__), \
'_te_jax_cuda*.so'))[0])") || return 1
  lib=$(ldd "$so" | awk '/libcublasLt/ {print $3}')
  [ -f "$lib" ] || { echo "lt_probe: libcublasLt not found from $so"; return 1; }
  nvcc -O2 -std=c++17 -arch=sm_90a -I"$(dirname "$lib")/../include" "$ROOT/tools/lt_probe.cu" \
    -L"$(dirname "$lib")" -l:"$(basename "$lib")" \
    -Xlinker -rpath -Xlinker "$(dirname "$lib")" -o "$exe" || return 1
  local scales=${4:-tensor}
  # shellcheck disable=SC2086  # LT_PROBE_ARGS holds several flags
  "$exe" "$1" "$2" "$3" --scales "$scales" ${LT_PROBE_ARGS:-} | tee "$OUT/$GPU_JOB.txt"
  return "${PIPESTATUS[0]}"
}
export -f tests_job bench_job train_job mesh_job scaling_job lt_probe_job

train_estimate() {  # rough seconds for a training run: compile and evaluation, then the steps
  awk -v recipe="$1" -v preset="$2" -v steps="$3" 'BEGIN {
    per_step = preset == "tiny" ? 0.05 : preset == "125m" ? 0.16 : 1.3
    if (recipe ~ /^(mxfp8|nvfp4|flax-fp8)(\+|$)/) per_step *= 1.5
    # --inspect: a second compile and the cost measurement at the end (2 x 31 steps)
    extra = recipe ~ /\+inspect/ ? 40 + 62 * per_step : 0
    printf "%d\n", 60 + extra + steps * per_step }'
}
preset_steps() { $PY -c "import sys; sys.path.insert(0, '$ROOT'); from examples.gpt.presets import PRESETS; print(PRESETS['$1'].steps)"; }

ordered=()
for arg in "$@"; do
  case "$arg" in
    --skip-build) build=0 ;;
    --wheel=*) wheel=${arg#--wheel=}; build=0 ;;
    --no-tests) run_tests=0 ;;
    --no-bench) run_bench=0 ;;
    --deadline=*) deadline=${arg#--deadline=} ;;
    --bench=*) bench_given=1; ordered+=("$arg") ;;
    --multi-gpu|--multi-gpu=*|--train=*|--tests|--lt-probe=*) ordered+=("$arg") ;;
    *) pytest_args+=("$arg") ;;
  esac
done
[ ${#pytest_args[@]} -eq 0 ] && pytest_args=(tests/)
pytest_args=("${pytest_args[@]/#tests\//}")
tests_line="tests|${TESTS_EST_S:-300}|1|tests_job ${pytest_args[*]}"
[ $run_tests -eq 1 ] && [[ " ${ordered[*]} " != *" --tests "* ]] && jobs+=("$tests_line")
[ $run_bench -eq 1 ] && [ $bench_given -eq 0 ] && ordered+=("--bench=$(ls benchmarks/bench_*.py | sed 's|.*/bench_||; s|\.py$||' | paste -sd,)")
for arg in "${ordered[@]}"; do
  case "$arg" in
    --bench=*)
      [ $run_bench -eq 1 ] || continue
      IFS=, read -ra names <<< "${arg#--bench=}"
      for b in "${names[@]}"; do jobs+=("bench_$b|${BENCH_EST_S:-120}|1|bench_job $b"); done ;;
    --tests) [ $run_tests -eq 1 ] && jobs+=("$tests_line") ;;
    --lt-probe=*)
      IFS=, read -ra dims <<< "${arg#--lt-probe=}"
      [[ "${dims[*]}" =~ ^[0-9]+\ [0-9]+\ [0-9]+(\ (tensor|1dx2d|2dx1d|1dx1d))?$ ]] \
        || { echo "gpu_check: --lt-probe takes M,N,K[,tensor|1dx2d|2dx1d|1dx1d], got ${arg#--lt-probe=}"; exit 2; }
      jobs+=("lt_probe_${dims[0]}x${dims[1]}x${dims[2]}_${dims[3]:-tensor}|${LT_PROBE_EST_S:-150}|1|lt_probe_job ${dims[*]}") ;;
    --multi-gpu) jobs+=("mesh|200|2|mesh_job" "dp_scaling|150|2|scaling_job") ;;
    --multi-gpu=*)
      [[ ,${arg#--multi-gpu=}, == *,mesh,* ]] && jobs+=("mesh|200|2|mesh_job")
      [[ ,${arg#--multi-gpu=}, == *,scaling,* ]] && jobs+=("dp_scaling|150|2|scaling_job") ;;
    --train=*)
      IFS=, read -ra runs <<< "${arg#--train=}"
      for r in "${runs[@]}"; do
        recipe=${r%%@*}; preset=${TRAIN_PRESET:-125m}; steps=${TRAIN_STEPS:-}
        if [[ $r == *@* ]]; then spec=${r#*@}; preset=${spec%%:*}; [[ $spec == *:* ]] && steps=${spec#*:}; fi
        est_steps=${steps:-$(preset_steps "$preset")}
        jobs+=("train_${recipe/+/_}_${preset}|$(train_estimate "$recipe" "$preset" "$est_steps")|1|train_job $recipe $preset $steps")
      done ;;
  esac
done

{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv; \
  $PY -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$LOGS/machine.log" 2>&1

if [ $build -eq 1 ]; then
  start=$(date +%s)
  rm -rf /tmp/te_wheel
  if ! $PY -m pip wheel --no-build-isolation --no-deps -v -w /tmp/te_wheel . \
      -C cmake.define.TE_JAX_CUDA=ON -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a > "$LOGS/build.log" 2>&1; then
    echo "gpu_check: BUILD FAILED"; tail -40 "$LOGS/build.log"; exit 1
  fi
  wheel=$(ls /tmp/te_wheel/te_jax-*.whl)
  cp "$wheel" "$OUT/"
  echo "gpu_check: built $(basename "$wheel") in $(( $(date +%s) - start )) s"
fi
if [ -n "$wheel" ]; then
  $PY -m pip install --no-deps --force-reinstall "$wheel" >> "$LOGS/build.log" 2>&1 \
    || { echo "gpu_check: installing $wheel failed"; tail -20 "$LOGS/build.log"; exit 1; }
fi
(cd /tmp && $PY -c "import te_jax, te_jax._ffi as f; assert f.CUDA_BUILT, 'CUDA handlers missing'; print('te_jax CUDA handlers:', f.TARGETS)") \
  >> "$LOGS/machine.log" 2>&1 || { echo "gpu_check: te_jax import failed"; tail -20 "$LOGS/machine.log"; exit 1; }

# A job listed again gets "_2", "_3", ... after its name, so its log and results do not replace the first's.
declare -A seen=()
for i in "${!jobs[@]}"; do
  name=${jobs[$i]%%|*}
  seen[$name]=$(( ${seen[$name]:-0} + 1 ))
  [ "${seen[$name]}" -gt 1 ] && jobs[$i]="${name}_${seen[$name]}|${jobs[$i]#*|}"
done
printf '%s\n' "${jobs[@]}" > "$LOGS/jobs.txt"
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd,)
# SM clock, power and temperature every 2 s while the jobs run (a power-capped GPU slows as it heats).
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits \
  -lms 2000 > "$LOGS/gpu_clocks.csv" 2>&1 &
clock_pid=$!
$PY "$ROOT/tools/gpu_jobs.py" "$LOGS/jobs.txt" --gpus "$gpus" --log "$OUT/jobs.log" --logs "$LOGS" \
  --deadline-s $(( deadline - ($(date +%s) - script_start) ))
kill $clock_pid 2>/dev/null
$PY - "$LOGS/gpu_clocks.csv" <<'PYEOF' || true
import collections, statistics, sys
by_gpu = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try:
        by_gpu[f[1]].append((float(f[2]), float(f[3]), float(f[4])))
    except (IndexError, ValueError):
        continue
for gpu, v in sorted(by_gpu.items()):
    clk, pw, temp = zip(*v)
    print(f"gpu_check: GPU {gpu} over {len(v)} samples: SM clock min/median/max {min(clk):.0f}/"
          f"{statistics.median(clk):.0f}/{max(clk):.0f} MHz, power max {max(pw):.0f} W, temperature max {max(temp):.0f} C")
PYEOF
$PY "$ROOT/tools/gpu_summary.py" "$OUT"
for f in train.log multi_gpu.log; do [ -f "$OUT/$f" ] && mv "$OUT/$f" "$LOGS/"; done
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
rm -f "$OUT"/bench_*.json "$OUT"/bench_*.md "$OUT/junit.xml"
