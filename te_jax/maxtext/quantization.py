"""``TeJaxQuantization``: MaxText's quantization object for a te_jax recipe (imports MaxText).

It subclasses MaxText's ``Fp8Quantization`` (flax's stateful FP8, the
``quantization=fp8`` choice) for one reason: MaxText's MoE layer builds the
experts' einsums at construction only for that class
(``quantizations.create_fp8_einsum``, ``maxtext.layers.moe``), which is where a
delayed-scaling state has to be created for MaxText's train step to step it.
Any other class gets einsums bridged on first call inside the traced step,
whose state would never be differentiated. Everything the parent defines is
replaced: the products are te_jax's (``te_jax.maxtext.ops``).
"""

from __future__ import annotations

from typing import Any

from maxtext.layers import quantizations

from te_jax.maxtext.ops import DotGeneralOp, EinsumOp
from te_jax.recipe import DelayedScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling
from te_jax.recipe.recipes import Recipe

__all__ = ["TeJaxQuantization"]


class TeJaxQuantization(quantizations.Fp8Quantization):
    """The members MaxText reads from a quantization object, for ``recipe``.

    ``quant_mode`` is "train" (te_jax quantizes training; MaxText's serve and
    convert modes are AQT's); ``needs_apply_rngs`` is True only for NVFP4 with
    stochastic rounding (keys from the "quantize" RNG stream);
    ``quantize_dtype`` is None, so MaxText's megablox/tokamax grouped matmul
    (``sparse_matmul=True``) does not quantize the experts itself on te_jax's
    behalf; ``get_block_size`` is the number of input rows MaxText's
    ``DenseGeneral`` initializes with (a whole block for block-scaled recipes).

    Attributes:
      name: the ``quantization=`` name it was chosen by (``"te_jax_current"``).
      recipe: the te_jax recipe.
      num_experts: the MoE expert count (config ``num_experts`` when above 1), for which the experts' einsums
        prepare the per-expert state of the down projection under delayed scaling (``EinsumOp``).
    """

    quant_mode = "train"
    quantize_dtype = None

    def __init__(self, name: str, recipe: Recipe, num_experts: int | None = None):
        self.name = name
        self.recipe = recipe
        self.num_experts = num_experts

    def __repr__(self) -> str:
        return f"TeJaxQuantization({self.name!r}, {self.recipe!r}, num_experts={self.num_experts!r})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, TeJaxQuantization) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((TeJaxQuantization, *self._key()))

    def _key(self) -> tuple[Any, ...]:
        return self.name, self.recipe, self.num_experts

    @property
    def needs_apply_rngs(self) -> bool:  # pylint: disable=invalid-overridden-method
        """Whether the products draw keys at apply time (NVFP4 with stochastic rounding)."""
        return isinstance(self.recipe, NVFP4BlockScaling) and not self.recipe.disable_stochastic_rounding

    @property
    def stateful(self) -> bool:
        """Whether the recipe keeps FP8 state across steps (delayed scaling)."""
        return isinstance(self.recipe, DelayedScaling)

    def dot_general_cls(self, mesh_axes: tuple[str, ...] = ()):
        """``DotGeneralOp`` bound to the recipe (MaxText instantiates it with no argument); no mesh axes needed."""
        del mesh_axes
        return _DotGeneralFactory(self.recipe)

    def einsum(self, dtype: Any = None, mesh_axes: tuple[str, ...] = ()) -> EinsumOp:
        """An ``EinsumOp`` instance (the MoE layer bridges it into NNX); the operands keep their own dtype."""
        del dtype, mesh_axes
        return EinsumOp(self.recipe, batch_groups=self.num_experts)

    def get_block_size(self) -> int:
        """The input rows MaxText's ``DenseGeneral`` initializes with: one block of a block-scaled recipe, else 1."""
        if isinstance(self.recipe, Float8BlockScaling):
            return 128
        if isinstance(self.recipe, MXFP8BlockScaling):
            return 32
        if isinstance(self.recipe, NVFP4BlockScaling):
            return 16
        return 1


class _DotGeneralFactory:
    """``DotGeneralOp(recipe, **kwargs)`` on call: the ``dot_general_cls`` MaxText calls with no arguments."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe

    def __call__(self, **kwargs: Any) -> DotGeneralOp:
        return DotGeneralOp(self.recipe, **kwargs)
