#!/usr/bin/env bash
# The test command: on a fresh machine it makes its own virtual environment
# (.venv), builds and installs te_jax into it, compile-checks the CUDA sources
# when nvcc is present (tools/compile_cuda.sh; a CUDA compile error fails the run), then runs pytest.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
PY=.venv/bin/python
$PY -m pip install -q --disable-pip-version-check \
  "jax>=0.6" "jaxlib>=0.6" "flax>=0.10" "optax>=0.2" "ml_dtypes>=0.5" \
  "nanobind>=2.4" "scikit-build-core>=0.10" cmake ninja "pytest>=8" pytest-xdist "hypothesis>=6" orbax-checkpoint tqdm \
  matplotlib "qwix>=0.1.8"
$PY -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . \
  -C cmake.define.TE_JAX_CUDA=OFF

if command -v nvcc >/dev/null 2>&1; then
  bash tools/compile_cuda.sh "$PY"
else
  echo "run_tests: nvcc not found; skipping the CUDA compile check"
fi

# On a machine without a GPU the suite is mostly XLA:CPU compilation of many small programs. Two flags
# make that cheaper: LLVM optimization level 0 (about two thirds of the time; no fast-math at either
# level, but sums may run in another order: tests/multidevice/test_distributed.py), and XLA:CPU's older elemental
# emitters for fusions instead of its MLIR fusion emitters (about 30% less again on the layer and
# quantize tests; the same HLO, emitted another way). Flags given in XLA_FLAGS come after, so they
# override these. A GPU machine keeps XLA's defaults (tools/gpu_check.py).
if ! command -v nvidia-smi >/dev/null 2>&1; then
  export XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false ${XLA_FLAGS:-}"
fi
# Two workers, one core each.
$PY -m pytest -q -n 2 "$@"
