"""The Linen modules MaxText calls for its quantized products, on te_jax's injected ``DotGeneral``.

MaxText (``maxtext.layers``) calls the modules of its quantization object as:

* ``dot_general_cls()`` in every ``DenseGeneral`` it quantizes (attention
  projections, MLP, the MoE router), bridged into NNX with ``nnx_wrappers.ToNNX``:
  ``(inputs, kernel, dimension_numbers, precision=None)``;
* ``einsum(dtype=...)`` in the MoE layer (``sparse_matmul=False``): ``(equation, inputs, kernel)``.

Both enter ``te_jax.autocast(recipe=...)`` around ``te_jax.flax.DotGeneral``, so
the recipe travels with the module, as TransformerEngine's does in MaxText,
and nothing outside the model has to be wrapped. Delayed scaling keeps its
state in flax's "_overwrite_with_gradient" collection, which MaxText's train
step differentiates and overwrites with its gradient (``te_jax.flax.inject``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax.core import DenseQuantizers
from te_jax.core.dot_general import parse_einsum
from te_jax.flax.inject import DotGeneral
from te_jax.recipe import BUILTIN
from te_jax.recipe.autocast import autocast
from te_jax.recipe.recipes import Recipe

__all__ = ["DotGeneralOp", "EinsumOp", "QUANTIZATION_PREFIX", "builtin_quantizations"]

QUANTIZATION_PREFIX = "te_jax_"
"""MaxText's ``quantization=`` names of te_jax's recipes: ``te_jax_<BUILTIN short name>`` (``te_jax_current``)."""


def builtin_quantizations() -> dict[str, Recipe]:
    """``{"te_jax_delayed": DelayedScaling(), "te_jax_current": ..., "te_jax_block": ..., ...}``: te_jax's built-ins."""
    return {QUANTIZATION_PREFIX + name: cls() for name, cls in BUILTIN.items()}


class DotGeneralOp(nn.Module):
    """``lax.dot_general`` for MaxText's ``dot_general_cls``: ``te_jax.flax.DotGeneral`` under ``recipe``.

    Called as MaxText calls it: ``(inputs, kernel, dimension_numbers, precision=None)``
    (keyword ``preferred_element_type`` also taken); the kernel is the weight.
    """

    recipe: Recipe

    @nn.compact
    def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision: Any = None,
                 preferred_element_type: Any = None) -> jax.Array:
        with autocast(recipe=self.recipe):
            return DotGeneral(name="te_jax")(lhs, rhs, dimension_numbers, precision=precision,
                                             preferred_element_type=preferred_element_type)


class EinsumOp(nn.Module):
    """A two-operand ``jnp.einsum(equation, inputs, kernel)`` for MaxText's MoE: ``DotGeneralOp``'s product.

    The equation becomes one ``dot_general`` (``te_jax.core.dot_general.parse_einsum``:
    size-1 broadcast axes and letters of one operand only are summed first,
    the output transposed after), so the state and its collection are
    ``DotGeneralOp``'s: child "dot_general" for products without batch
    letters, "batched" for products with them (letters of both operands and
    the output, such as the expert axis of the MoE's down projection
    ``"BSEH,EHM -> BSEM"``), which run on the grouped GEMM with one weight amax
    history per batch element under delayed scaling.

    MaxText creates the einsum's variables once, with a 1x1 product
    (``quantizations.create_fp8_einsum``), before it knows the equation, and
    steps only variables created then. So under a stateful recipe the
    initialization also creates the "batched" state for ``batch_groups`` batch
    elements (the MoE's expert count); a batched product of another size then
    raises te_jax's error naming the sizes. MaxText's ``precision`` and other
    keywords are taken; ``precision`` is passed on.

    Attributes:
      recipe: the te_jax recipe.
      batch_groups: the product of the batch sizes of the batched products to prepare state for, or None.
    """

    recipe: Recipe
    batch_groups: int | None = None

    @nn.compact
    def __call__(self, equation: str, lhs: jax.Array, rhs: jax.Array, precision: Any = None,
                 preferred_element_type: Any = None, **unused: Any) -> jax.Array:
        plan = parse_einsum(equation, tuple(lhs.shape), tuple(rhs.shape))
        lhs = _sum(lax.squeeze(lhs, plan.lhs_squeeze), plan.lhs_sum)
        rhs = _sum(lax.squeeze(rhs, plan.rhs_squeeze), plan.rhs_sum)
        batched = bool(plan.dimension_numbers[1][0])
        if self.is_initializing() and not batched and self.batch_groups and self._stateful():
            g = self.batch_groups
            DotGeneralOp(self.recipe, name="batched")(jnp.zeros((g, 1, 1), lhs.dtype), jnp.zeros((g, 1, 1), rhs.dtype),
                                                      (((2,), (1,)), ((0,), (0,))))
        op = DotGeneralOp(self.recipe, name="batched" if batched else "dot_general")
        y = op(lhs, rhs, plan.dimension_numbers, precision=precision, preferred_element_type=preferred_element_type)
        return y if plan.transpose is None else lax.transpose(y, plan.transpose)

    def _stateful(self) -> bool:
        return bool(DenseQuantizers.from_recipe(self.recipe, ()).stateful())


def _sum(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    return x if not axes else lax.reduce(x, np.array(0, x.dtype), lax.add, axes)
