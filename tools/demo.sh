#!/usr/bin/env bash
# The demo command: on a fresh machine it makes the same virtual environment
# as tools/run_tests.sh (.venv), installs te_jax with its "examples" extra
# (tqdm, matplotlib, orbax-checkpoint), and trains the tiny GPT of
# examples/gpt with bf16 and two FP8 recipes, printing a comparison table and
# the path of a loss-curve plot. On a machine with an NVIDIA GPU it installs
# jax's CUDA plugin and builds te_jax's CUDA kernels (when nvcc is found),
# so the same command trains on the GPU. Extra arguments go to
# examples/gpt/demo.py (e.g. --steps 100, --recipes bf16,mxfp8).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
PY=.venv/bin/python
PIP=($PY -m pip install -q --disable-pip-version-check)

jax_pkgs=("jax>=0.6" "jaxlib>=0.6")
cuda=OFF
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "demo: NVIDIA GPU found; installing jax with its CUDA 13 plugin"
  jax_pkgs=("jax[cuda13]>=0.6")
  cuda=AUTO  # CUDA kernels when nvcc and cuBLASLt are found; the demo says so when they are not
fi
# Build requirements as in tools/run_tests.sh, then te_jax itself with the examples extra.
"${PIP[@]}" "${jax_pkgs[@]}" "flax>=0.10" "optax>=0.2" "ml_dtypes>=0.5" \
  "nanobind>=2.4" "scikit-build-core>=0.10" cmake ninja
"${PIP[@]}" --no-build-isolation -e ".[examples]" -C cmake.define.TE_JAX_CUDA=$cuda

exec $PY examples/gpt/demo.py "$@"
