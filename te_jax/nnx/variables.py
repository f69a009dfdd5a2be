"""The ``nnx.Variable`` types of te_jax's FP8 state and quantization statistics."""

from __future__ import annotations

from flax import nnx


class FP8Meta(nnx.Variable):
    """A layer's FP8 state: ``{role: state}`` (``LayerNormMLP``: ``{"wi": {...}, "wo": {...}}``).

    The same layout as the Linen layers' "fp8_meta" entries (delayed
    scaling: ``{"amax_history": f32[L], "scale": f32[1]}`` per role). Not a
    parameter: ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` never sees it;
    ``te_jax.nnx.value_and_grad`` applies each step's update.
    """


class FP8Stats(nnx.Variable):
    """A layer's quantization statistics (``te_jax.inspect``), laid out like ``FP8Meta``.

    Created under ``te_jax.autocast(..., inspect=True)``; after each
    ``te_jax.nnx.value_and_grad`` step it holds that step's statistics.
    """
