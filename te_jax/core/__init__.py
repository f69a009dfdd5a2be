"""The core floor: the functional ops and everything they share, written once.

The functional ops ``dense``, ``layernorm_dense``, ``layernorm_mlp``,
``grouped_dense`` and ``grouped_mlp`` are ``jax.custom_vjp`` functions with
one signature, ``op(x, ..., *, quantizers=None, state=None, key=None) ->
(y, new_state)``, built on:

* ``bundles``: the quantizer bundles (``DenseQuantizers``, ``MLPQuantizers``),
  their declared interface (``QuantizerBundle``), the field <-> role map and
  the trace-time checks (dtypes, state, keys) with one message per mistake,
  whichever op meets it;
* ``gemm_quant``: ``GemmQuant`` (quantize with state, a key per role, the
  statistics, the GEMM call), the cotangents of state and parameters, the
  checkpoint names and policies, and the norm fused into a GEMM input's cast;
* ``state``: the plan every custom VJP carries, the op's state in and out
  (statistics included), and who may differentiate through FP8 state
  (``FP8StateError``, ``fp8_state_updates``);
* ``stats``: the quantization statistics ``te_jax.inspect`` reports;
* ``layer_support``: what the Linen and NNX layers share and what knows no
  module system (dtype and axis checks, flax's norm order, dropout masks).

``dot_general`` and ``einsum`` (``te_jax.core.dot_general``) are
``lax.dot_general`` / ``jnp.einsum`` on those ops, for injection points.

The quantizers in a bundle follow ``te_jax.quantize.protocols``; each op's
custom VJP saves its residuals as a NamedTuple (``_Residuals``) the backward
reads by name.
"""

from te_jax.core.bundles import check_gemm, check_high_precision, check_no_dot_general, raw_key
from te_jax.core.gemm_quant import GemmQuant, cotangent, keep, mesh_resource_or_autocast, state_cotangent, \
    state_leaves, vary_of
from te_jax.core.gemm_quant import STATS, Plan, given_stats, high_precision_state, split_stats, updated_state, \
    with_stats
from te_jax.core.bundles import GEMMS, DenseQuantizers, MLPQuantizers, QuantizerBundle, as_mlp_quantizers, \
    as_quantizers
from te_jax.core.gemm_quant import NORM_STATS, PRE_ACTIVATION, QUANTIZED, fp8_checkpoint_policy, name_quantized, \
    save_fp8_policy
from te_jax.core.gemm_quant import NORM_ACT_OUTPUT, offload_fp8_policy, recompute_norm_act_policy, \
    save_fp8_and_pre_activation_policy, save_nothing_policy

__all__ = [
    "GEMMS", "NORM_ACT_OUTPUT", "NORM_STATS", "PRE_ACTIVATION", "QUANTIZED", "STATS", "DenseQuantizers", "GemmQuant", "MLPQuantizers",
    "Plan", "QuantizerBundle", "as_mlp_quantizers", "as_quantizers", "check_gemm", "check_high_precision",
    "check_no_dot_general",
    "cotangent", "fp8_checkpoint_policy", "given_stats", "high_precision_state", "keep", "mesh_resource_or_autocast",
    "name_quantized", "offload_fp8_policy", "raw_key", "recompute_norm_act_policy", "save_fp8_and_pre_activation_policy",
    "save_fp8_policy", "save_nothing_policy", "split_stats", "state_cotangent", "state_leaves", "updated_state",
    "vary_of", "with_stats", "dot_general", "einsum", "ragged_dot",
]

# Last: these ops import the names above from this package.
from te_jax.core.dot_general import dot_general, einsum  # noqa: E402
from te_jax.core.ragged_dot import ragged_dot  # noqa: E402
