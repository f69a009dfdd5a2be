"""The functional core that ``te_jax.dense``, ``te_jax.layernorm_dense`` and ``te_jax.layernorm_mlp`` share.

Each op is a thin custom VJP over these pieces, written once:

* ``quantizers``: the quantizer bundles (``DenseQuantizers``, ``MLPQuantizers``)
  and the field <-> role map.
* ``checks``: trace-time checks (dtypes, block shapes, state, keys) with one
  message per mistake, whichever op meets it.
* ``gemm_quant``: ``GemmQuant`` (quantize with state, a key per role, the
  statistics of ``te_jax.inspect``, the GEMM call) and the cotangents of
  state and parameters.
* ``op_state``: the plan every custom VJP carries, and the op's state in and
  out (statistics included).
* ``norm``: the norm fused into a GEMM input's cast.
* ``remat``: the checkpoint names and policies.
"""

from te_jax._core.checks import check_gemm, check_high_precision, check_no_dot_general, raw_key
from te_jax._core.gemm_quant import GemmQuant, cotangent, keep, mesh_resource_or_autocast, state_cotangent, \
    state_leaves, vary_of
from te_jax._core.op_state import STATS, Plan, given_stats, high_precision_state, split_stats, updated_state, \
    with_stats
from te_jax._core.quantizers import GEMMS, DenseQuantizers, MLPQuantizers, as_mlp_quantizers, as_quantizers
from te_jax._core.remat import NORM_STATS, PRE_ACTIVATION, QUANTIZED, fp8_checkpoint_policy, name_quantized, \
    save_fp8_policy

__all__ = [
    "GEMMS", "NORM_STATS", "PRE_ACTIVATION", "QUANTIZED", "STATS", "DenseQuantizers", "GemmQuant", "MLPQuantizers",
    "Plan", "as_mlp_quantizers", "as_quantizers", "check_gemm", "check_high_precision", "check_no_dot_general",
    "cotangent", "fp8_checkpoint_policy", "given_stats", "high_precision_state", "keep", "mesh_resource_or_autocast",
    "name_quantized", "raw_key", "save_fp8_policy", "split_stats", "state_cotangent", "state_leaves", "updated_state",
    "vary_of", "with_stats",
]
