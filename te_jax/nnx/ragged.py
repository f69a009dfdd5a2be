"""``te_jax.nnx.RaggedDot``: ``jax.lax.ragged_dot`` as an NNX module that keeps the FP8 state of its GEMMs.

A mixture-of-experts layer injects it where it called ``jax.lax.ragged_dot``::

    with te_jax.autocast(recipe=recipe):                     # the recipe's state is created at construction
        self.wi_dot = te_jax.nnx.RaggedDot(num_experts, rngs=rngs)
    h = self.wi_dot(x_sorted, self.wi[...], group_sizes)     # was jax.lax.ragged_dot(x_sorted, wi, group_sizes)

It computes ``te_jax.ragged_dot``: exactly ``jax.lax.ragged_dot`` outside
``te_jax.autocast``, the recipe's quantized grouped GEMMs under it, delayed
scaling included. The state is an ``FP8Meta`` with the Linen module's layout
(``{role: state}``, the weight's with the experts' leading axis), read by a
call and stepped by ``te_jax.nnx.value_and_grad``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
from flax import nnx

from te_jax.core import DenseQuantizers
from te_jax.core.ragged_dot import ragged_dot_with_state
from te_jax.moe.experts import ExpertQuantizers
from te_jax.nnx._fp8 import Layer, call_quantizers, init_fp8, run_op, where


class RaggedDot(Layer):
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)``, quantized under ``te_jax.autocast`` with FP8 state.

    No parameters: ``rhs`` (the experts' weights) belongs to the calling layer. Each call site needs its own
    instance (one shared by two GEMMs would merge their state).

    Args:
      num_groups: g, the experts whose weights ``rhs`` holds (the delayed-scaling state keeps one amax history per
        expert weight, so it is made at construction).
      rngs: a "quantize" stream gives the stochastic-rounding keys (NVFP4 gradients).
      path: the module path the recipe's roles carry (``te_jax.recipe.Role.path``), ``"moe/wi_dot"`` or
        ``("moe", "wi_dot")``; left out (None), its path in the model, which ``te_jax.nnx.name_paths(model)``
        gives it.
    """

    single_owner = True

    def __init__(self, num_groups: int, *, rngs: nnx.Rngs | None = None, path: str | Sequence[str] | None = None):
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
            raise ValueError(f"te_jax: RaggedDot: num_groups must be a positive int (the experts of rhs), got "
                             f"{num_groups!r}")
        self.set_path(path)
        self.num_groups = num_groups
        init_fp8(self, rngs)

    def fp8_quantizers(self, recipe) -> ExpertQuantizers:
        return ExpertQuantizers(DenseQuantizers.from_recipe(recipe, self.path or ()), self.num_groups)

    def __call__(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, precision=None,
                 preferred_element_type=None) -> jax.Array:
        """``[m, k] x [g, k, n]`` -> ``[m, n]``, as ``jax.lax.ragged_dot`` (see ``te_jax.ragged_dot``)."""
        quantizers = call_quantizers(self)
        if quantizers.any and (getattr(rhs, "ndim", 0) != 3 or rhs.shape[0] != self.num_groups):
            raise ValueError(f"te_jax: {where(self)}: rhs must be [g, k, n] with g = num_groups = "
                             f"{self.num_groups}, got shape {getattr(rhs, 'shape', None)}")
        op = functools.partial(ragged_dot_with_state, lhs, rhs, group_sizes, precision, preferred_element_type,
                               quantizers=quantizers.q, where=where(self))
        return run_op(self, quantizers, op)
