"""Flax Linen layers whose GEMMs run in FP8/FP4 under ``te_jax.autocast``.

::

    import te_jax
    from te_jax import flax as te_flax      # or: import te_jax.flax as te_flax

    model = te_flax.LayerNormMLP(intermediate_dim=4096)
    with te_jax.autocast(recipe=te_jax.recipe.DelayedScaling()):
        variables = model.init(key, x)            # creates "params" and "fp8_meta"
        y = model.apply(variables, x)

Each layer takes its flax.linen namesake's arguments (plus logical axis names
for its parameters) and, with autocast off, computes what that namesake
computes (``MoE``, which has no flax namesake, computes in high precision).
The functional cores are ``te_jax.dense``, ``te_jax.grouped_dense``,
``te_jax.layernorm_dense`` and ``te_jax.layernorm_mlp``.

Quantization statistics: under ``te_jax.autocast(..., inspect=True)`` each
layer also records its tensors' statistics in the "fp8_stats" collection
(``te_jax.inspect``, docs/inspect.md).

Rematerialization: ``nn.remat(Layer, policy=te_jax.flax.save_fp8_policy)``
keeps the FP8 copies (and norm statistics) instead of recomputing the casts
in backward; ``fp8_checkpoint_policy(PRE_ACTIVATION)`` also keeps the MLP's
first GEMM output. Every layer's quantized copies carry these names (the
functional cores name them; ``te_jax.core.gemm_quant``).
"""

from te_jax.flax.dense import DenseGeneral
from te_jax.flax.layernorm import LayerNorm, LayerNormDenseGeneral
from te_jax.flax.mlp import LayerNormMLP
from te_jax.flax.moe import MoE
from te_jax.flax.transformer import SelfAttention, TransformerLayer, rotary_embedding
from te_jax.core.gemm_quant import NORM_STATS, PRE_ACTIVATION, QUANTIZED, fp8_checkpoint_policy, save_fp8_policy

__all__ = [
    "DenseGeneral", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP", "MoE", "NORM_STATS", "PRE_ACTIVATION",
    "QUANTIZED", "SelfAttention", "TransformerLayer", "fp8_checkpoint_policy", "rotary_embedding",
    "save_fp8_policy",
]
