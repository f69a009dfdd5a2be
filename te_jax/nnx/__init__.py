"""Flax NNX layers whose GEMMs run in FP8/FP4 under ``te_jax.autocast``.

::

    from flax import nnx
    import te_jax

    with te_jax.autocast(recipe=te_jax.recipe.DelayedScaling()):
        model = te_jax.nnx.LayerNormMLP(512, 2048, rngs=nnx.Rngs(0))   # creates its FP8Meta
    with te_jax.autocast(recipe=te_jax.recipe.DelayedScaling()):
        loss, grads = te_jax.nnx.value_and_grad(loss_fn)(model, x)      # also steps the FP8 state

Each layer takes its flax.nnx namesake's arguments (``Linear``,
``LinearGeneral``, ``LayerNorm``, ``RMSNorm``) or its te_jax.flax
counterpart's in NNX form (``LayerNormLinear``, ``LayerNormMLP``, ``MoE``,
``TransformerLayer``), and, with autocast off, computes what flax computes.
The numerics are the functional cores' (``te_jax.dense``,
``te_jax.layernorm_dense``, ``te_jax.layernorm_mlp``), as for the Linen
layers, and the FP8 state has the Linen layers' layout and semantics.

The state lives in ``te_jax.nnx.FP8Meta`` variables, created when a layer
is constructed under ``te_jax.autocast(recipe=...)``: ``nnx.state(model,
FP8Meta)`` splits it out, ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` never
touches it, and ``te_jax.nnx.value_and_grad`` applies its update after each
forward and backward (``te_jax.nnx.train``). Calling a layer reads it and
leaves it unchanged (``te_jax.nnx.calibrate`` applies a forward pass's update).

Every layer knows its module path (the path a ``CustomRecipe``'s roles carry
and ``te_jax.inspect`` names its rows by): ``path=``, or its place in the
model, which ``te_jax.nnx.name_paths(model)`` gives it (``value_and_grad``
calls it). flax.nnx's own ``Linear``, ``LinearGeneral`` and ``Einsum`` run on
te_jax's GEMMs through an injected ``DotGeneral`` / ``EinsumOp``
(``te_jax.nnx.inject(model)`` gives every one its own); ``te_jax.nnx.Einsum``
is flax.nnx's ``Einsum`` on them.
"""

from te_jax.nnx.einsum import Einsum
from te_jax.nnx.inject import DotGeneral, EinsumOp, inject
from te_jax.nnx.linear import Linear, LinearGeneral
from te_jax.nnx.mlp import LayerNormMLP
from te_jax.nnx.moe import MoE
from te_jax.nnx.normalization import LayerNorm, LayerNormLinear, RMSNorm
from te_jax.nnx.paths import name_paths
from te_jax.nnx.ragged import RaggedDot
from te_jax.nnx.train import calibrate, grad, value_and_grad
from te_jax.nnx.transformer import SelfAttention, TransformerLayer
from te_jax.nnx.variables import FP8Meta, FP8Stats

__all__ = ["DotGeneral", "Einsum", "EinsumOp", "FP8Meta", "FP8Stats", "LayerNorm", "LayerNormLinear", "LayerNormMLP",
           "Linear", "LinearGeneral", "MoE", "RaggedDot", "RMSNorm", "SelfAttention", "TransformerLayer", "calibrate", "grad",
           "inject", "name_paths", "value_and_grad"]
