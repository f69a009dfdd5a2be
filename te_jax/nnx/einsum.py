"""``Einsum``: flax.nnx's namesake whose product runs on ``te_jax.core.einsum`` under ``te_jax.autocast``."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import opt_einsum
from flax import nnx
from flax.nnx.nn import dtypes

from te_jax.core import DenseQuantizers
from te_jax.nnx._fp8 import Layer, init_fp8, recipe_or_none, where
from te_jax.nnx._product import check_batch_size, einsum_batch, einsum_batch_of_kernel, flat_einsum, run_product
from te_jax.nnx.linear import default_bias_init, default_kernel_init

Dtype = Any


def _check_equation(equation: str, where_: str) -> str:
    """flax.nnx.Einsum's check: an explicit equation ("->") of exactly two operands (spaces removed)."""
    equation = equation.replace(" ", "")
    if "->" not in equation:
        raise ValueError(f"te_jax: {where_}: the einsum equation {equation!r} must be explicit and include '->'")
    if equation.count(",") != 1:
        raise ValueError(f"te_jax: {where_}: the einsum equation {equation!r} must have exactly two operands (one "
                         f"comma), got {equation.count(',') + 1}")
    return equation


class Einsum(Layer):
    """``flax.nnx.Einsum`` (same arguments, parameters, initialization and, without autocast, result) on
    ``te_jax.core.einsum``.

    ``y = einsum(equation, inputs, kernel) + bias``; the kernel is the
    weight. Under ``te_jax.autocast(recipe=...)`` the forward, dgrad and
    wgrad GEMMs quantize with the recipe as ``te_jax.nnx.Linear``'s do, the
    FP8 state (delayed scaling) in ``fp8_meta``; an equation with batch axes
    (kernel letters the input and the output also have, e.g. "ecd,edf->ecf")
    runs on the grouped GEMM, its weight state with one amax history per
    batch element. ``out_sharding`` is honoured under autocast too (the result
    resharded as flax's product types it).

    Args:
      einsum_str, kernel_shape, bias_shape, dtype, param_dtype, precision,
        kernel_init, bias_init, promote_dtype, einsum_op,
        preferred_element_type, rngs, kernel_metadata, bias_metadata: as
        ``flax.nnx.Einsum``. A custom ``einsum_op`` is honoured outside
        autocast only.
      path: the module path the recipe's roles carry (see ``te_jax.nnx.Linear``).
    """

    def __init__(self, einsum_str: str, kernel_shape: Sequence[int], bias_shape: Sequence[int] | None = None, *,
                 dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32, precision: Any = None,
                 kernel_init=default_kernel_init, bias_init=default_bias_init, promote_dtype=dtypes.promote_dtype,
                 einsum_op=jnp.einsum, preferred_element_type: Dtype | None = None, rngs: nnx.Rngs,
                 kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
                 bias_metadata: Mapping[str, Any] = MappingProxyType({}), path: str | Sequence[str] | None = None):
        self.set_path(path)
        einsum_str = _check_equation(einsum_str, where(self))
        self.kernel = nnx.Param(kernel_init(rngs.params(), kernel_shape, param_dtype), **kernel_metadata)
        self.bias: nnx.Param | None
        if bias_shape is not None:
            self.bias = nnx.Param(bias_init(rngs.params(), bias_shape, param_dtype), **bias_metadata)
        else:
            self.bias = nnx.data(None)
        self.einsum_str = einsum_str
        self.kernel_shape = kernel_shape
        self.bias_shape = bias_shape
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.promote_dtype = promote_dtype
        self.einsum_op = einsum_op
        self.preferred_element_type = preferred_element_type
        self.batch_size = check_batch_size(einsum_batch_of_kernel(einsum_str, tuple(kernel_shape)), where(self))
        init_fp8(self, rngs)

    def fp8_quantizers(self, recipe) -> DenseQuantizers:
        return DenseQuantizers.from_recipe(recipe, self.path or ())

    def fp8_initial_state(self, quantizers: DenseQuantizers) -> dict[str, Any]:
        return quantizers.init_state(num_groups=self.batch_size)

    def __call__(self, inputs: jax.Array, einsum_str: str | None = None, out_sharding=None) -> jax.Array:
        """``einsum(einsum_str, inputs, kernel) + bias`` (``einsum_str``: the constructor's when None)."""
        equation = _check_equation(einsum_str if einsum_str is not None else self.einsum_str, where(self))
        inputs, kernel, bias = self.promote_dtype(
            (inputs, self.kernel[...], self.bias[...] if self.bias is not None else None), dtype=self.dtype)
        kwargs = {"out_sharding": out_sharding}
        if self.preferred_element_type is not None:
            kwargs["preferred_element_type"] = self.preferred_element_type
        flax_op = functools.partial(self.einsum_op, equation, inputs, kernel, precision=self.precision, **kwargs)
        if self.einsum_op is not jnp.einsum and recipe_or_none() is not None:
            raise ValueError(f"te_jax: {where(self)}: a custom einsum_op cannot be combined with te_jax.autocast "
                             "(te_jax's quantized GEMMs replace it); drop it or call outside autocast")
        core_op = functools.partial(flat_einsum, equation, inputs, kernel, precision=self.precision,
                                    preferred_element_type=self.preferred_element_type)
        y = run_product(self, flax_op, core_op, lambda: einsum_batch(equation, jnp.shape(inputs), jnp.shape(kernel)),
                        out_sharding)
        if bias is not None:
            y += jnp.reshape(bias, self._broadcasted_bias_shape(equation, inputs, kernel))
        return y

    def _broadcasted_bias_shape(self, equation: str, lhs: jax.Array, rhs: jax.Array) -> list[int]:
        """flax.nnx.Einsum's: the kernel's sizes at the output's kernel letters, 1 elsewhere."""
        operands, result, _ = opt_einsum.parser.parse_einsum_input((equation, lhs, rhs))
        rhs_axes = {c: i for i, c in enumerate(operands.split(",")[1])}
        return [self.kernel_shape[rhs_axes[c]] if c in rhs_axes else 1 for c in result]
