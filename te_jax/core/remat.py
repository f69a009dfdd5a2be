"""Rematerialization names of the functional ops and the policies that save them.

Every forward quantized copy is named ``QUANTIZED`` (``name_quantized``), a
norm's mean and rsigma ``NORM_STATS`` and an MLP's first GEMM output
``PRE_ACTIVATION``. ``save_fp8_policy`` (a ``jax.checkpoint`` / ``nn.remat``
policy) keeps the FP8 copies and norm statistics, so backward recomputes only
GEMMs and elementwise work, never a cast; ``fp8_checkpoint_policy(PRE_ACTIVATION)``
also keeps the MLP's first GEMM output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

QUANTIZED = "te_jax_quantized"  # every forward quantized copy (inputs, weights, activations)
NORM_STATS = "te_jax_norm_stats"  # a norm's mean and rsigma
PRE_ACTIVATION = "te_jax_pre_activation"  # an MLP's first GEMM output


def fp8_checkpoint_policy(*extra_names: str):
    """A remat policy that saves the FP8 copies and norm statistics (plus ``extra_names``)."""
    return jax.checkpoint_policies.save_only_these_names(QUANTIZED, NORM_STATS, *extra_names)


save_fp8_policy = fp8_checkpoint_policy()


def name_quantized(t):
    """``checkpoint_name(t, QUANTIZED)``, with FP8 leaves named as their uint8 bits.

    Remat inserts ``reduce_precision(x, **finfo(x.dtype))`` on saved float
    residuals, which for float8_e4m3fn follows IEEE rules and turns every value
    of magnitude >= 256 into NaN (jax 0.10). The bits saved as uint8 are left alone.
    """

    def one(v):
        if v is None or not (jnp.issubdtype(v.dtype, jnp.floating) and jnp.dtype(v.dtype).itemsize == 1):
            return checkpoint_name(v, QUANTIZED)
        bits = checkpoint_name(lax.bitcast_convert_type(v, jnp.uint8), QUANTIZED)
        return lax.bitcast_convert_type(bits, v.dtype)

    return jax.tree.map(one, t)
