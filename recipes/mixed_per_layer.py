"""Mixed per layer: MXFP8 attention projections, per-tensor current-scaling FP8 MLP.

Attention projections (a module path containing ``attention``, ``attn``,
``query``, ``key``, ``value``, ``qkv`` or ``out_proj``) use MXFP8 (E4M3, 1x32
blocks with power-of-two scales); MLP layers (a path containing ``mlp``,
``ffn``, ``wi``, ``wo`` or ``fc``) use per-tensor current scaling with E4M3
forward and E5M2 gradients. Everything else stays in high precision. Both
operands of a GEMM always get the same scaling mode, as the GEMMs require.
"""

import re

import jax.numpy as jnp

from te_jax.quantize import CurrentScalingQuantizer, MXFP8Quantizer

ATTENTION = re.compile(r"attention|attn|query|key|value|qkv|out_proj", re.IGNORECASE)
MLP = re.compile(r"mlp|ffn|^wi|^wo|^fc", re.IGNORECASE)


def qfactory(role):
    path = getattr(role, "path", ())
    if role in ("linear_output", "linear_grad_input"):
        return None
    if any(ATTENTION.search(name) for name in path):
        return MXFP8Quantizer(jnp.float8_e4m3fn)
    if any(MLP.search(name) for name in path):
        dtype = jnp.float8_e5m2 if role == "linear_grad_output" else jnp.float8_e4m3fn
        return CurrentScalingQuantizer(dtype=dtype)
    return None
