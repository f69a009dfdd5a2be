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
``DotGeneral`` goes where flax.linen takes a ``dot_general_cls`` (nn.Dense,
nn.DenseGeneral, nn.MultiHeadDotProductAttention) and keeps its state in
flax's "_overwrite_with_gradient" collection (``te_jax.flax.inject``).
The functional cores are ``te_jax.dense``, ``te_jax.grouped_dense``,
``te_jax.layernorm_dense`` and ``te_jax.layernorm_mlp``.

Quantization statistics: under ``te_jax.autocast(..., inspect=True)`` each
layer also records its tensors' statistics in the "fp8_stats" collection
(``te_jax.inspect``, docs/inspect.md).

Rematerialization: ``nn.remat(Layer, policy=te_jax.flax.save_fp8_policy)``
keeps the FP8 copies (and norm statistics) instead of recomputing the casts
in backward; ``save_fp8_and_pre_activation_policy`` also keeps the MLP's
first GEMM output, ``save_nothing_policy`` only the block's input, and
``offload_fp8_policy()`` moves the FP8 copies to host memory until the
backward. Every layer's quantized copies carry these names (the functional
cores name them; ``te_jax.core.gemm_quant``). Without remat, a layer's
``recompute_norm_act=True`` drops the norm's and activation's outputs
(their FP8 copies under a recipe) from what the backward keeps, and
recomputes them there from the input and pre-activation it keeps anyway.
Memory of each choice: benchmarks/README.md, "Memory".
"""

from te_jax.flax.dense import Dense, DenseGeneral
from te_jax.flax.einsum import Einsum
from te_jax.flax.inject import DotGeneral
from te_jax.flax.layernorm import LayerNorm, LayerNormDenseGeneral
from te_jax.flax.mlp import LayerNormMLP
from te_jax.flax.moe import MoE
from te_jax.flax.ragged import RaggedDot
from te_jax.flax.transformer import SelfAttention, TransformerLayer, rotary_embedding
from te_jax.core.gemm_quant import NORM_STATS, PRE_ACTIVATION, QUANTIZED, fp8_checkpoint_policy, save_fp8_policy
from te_jax.core.gemm_quant import (NORM_ACT_OUTPUT, offload_fp8_policy, save_fp8_and_pre_activation_policy,
                                    save_nothing_policy)

__all__ = [
    "Dense", "DenseGeneral", "DotGeneral", "Einsum", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP", "MoE",
    "NORM_ACT_OUTPUT", "NORM_STATS", "PRE_ACTIVATION",
    "QUANTIZED", "RaggedDot", "SelfAttention", "TransformerLayer", "fp8_checkpoint_policy", "rotary_embedding",
    "offload_fp8_policy", "save_fp8_and_pre_activation_policy", "save_fp8_policy", "save_nothing_policy",
]
