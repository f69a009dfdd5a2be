"""``te_jax.flax.DenseGeneral`` and ``te_jax.flax.Dense``: flax.linen's namesakes whose GEMMs run in FP8 under
te_jax.autocast."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from jax import lax

from te_jax.core import DenseQuantizers
from te_jax.core.dense import dense
from te_jax.flax import _common as C
from te_jax.flax._common import call_op
from te_jax.flax._common import module_path

Dtype = Any


class DenseGeneral(nn.Module):
    """A linear transformation with flexible axes; quantized with the active autocast recipe.

    Same arguments, parameters ("kernel" ``[*in axes, *features]``, "bias"
    ``features``), input dtype rules (NumPy float64 and integer inputs are
    promoted as flax promotes them, also under autocast) and, without
    autocast, the same result as ``flax.linen.DenseGeneral``. Under ``te_jax.autocast(recipe=...)`` it
    calls ``te_jax.dense``: forward, dgrad and wgrad GEMMs quantized, the
    roles carrying this module's path. Delayed-scaling state lives in
    ``fp8_meta/<path>/<role>``.

    Attributes:
      features: int or tuple of output features.
      axis: int or tuple of input axes to contract; the kernel takes them in
        ascending order (as flax's does), whatever order they are given in.
      batch_dims: leading batch axes shared by input and kernel (high precision only).
      use_bias: add a bias.
      dtype: the computation dtype (default: inferred from input and params).
      param_dtype: the parameters' dtype.
      kernel_init, bias_init: initializers (the kernel's sees the flattened
        ``[prod(in), prod(features)]`` shape, as in flax).
      precision: ``lax.dot_general`` precision of the high-precision path.
      promote_dtype: flax's dtype promotion of ``(inputs, kernel, bias)``.
      kernel_axes, bias_axes: logical axis names (``nn.with_logical_partitioning``); () for none.
      dot_general, dot_general_cls: flax's (deprecated) custom products, honoured
        without autocast only; they conflict with te_jax's quantized GEMMs.
    """

    features: int | Sequence[int]
    axis: int | Sequence[int] = -1
    batch_dims: Sequence[int] = ()
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    kernel_init: C.Initializer = nn.initializers.lecun_normal()
    bias_init: C.Initializer = nn.initializers.zeros_init()
    precision: Any = None
    promote_dtype: Any = promote_dtype
    kernel_axes: tuple[str | None, ...] = ()
    bias_axes: tuple[str | None, ...] = ()
    dot_general: Any = None
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Contracts ``axis`` of ``inputs`` with the kernel: ``[*other axes, *features]``."""
        C.check_dtypes(self)  # the input's dtype after promotion, as flax's
        inputs = jnp.asarray(inputs)
        features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        axis = tuple(sorted(C.canonical_axes(self.axis, inputs.ndim, self)))  # the kernel's order, as flax's
        batch = C.canonical_axes(self.batch_dims, inputs.ndim, self, "batch_dims") if self.batch_dims else ()
        if batch and set(batch) != set(range(len(batch))):
            raise ValueError(f"te_jax: {C.where(self)}: batch_dims {self.batch_dims} must be consecutive leading axes")
        if set(batch) & set(axis):
            raise ValueError(f"te_jax: {C.where(self)}: batch_dims and axis overlap")
        batch_shape = tuple(inputs.shape[a] for a in batch)
        in_shape = tuple(inputs.shape[a] for a in axis)
        kernel = C.param(self, "kernel", C.flat_init(self.kernel_init, len(batch) + len(axis)),
                         batch_shape + in_shape + features, self.param_dtype, self.kernel_axes)
        bias = None
        if self.use_bias:
            bias = C.param(self, "bias", C.flat_bias_init(self.bias_init), batch_shape + features, self.param_dtype,
                           self.bias_axes)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        C.check_dtypes(self, inputs)
        recipe = C.recipe_of_dense(self)
        custom = self.dot_general is not None or self.dot_general_cls is not None
        if batch or custom:
            if recipe is not None:
                raise ValueError(f"te_jax: {C.where(self)}: batch_dims are not supported under te_jax.autocast "
                                 "(the quantized GEMMs have no batch axes); vmap the layer or fold them into axis")
            return self._flax_product(inputs, kernel, bias, axis, batch, features)
        quantizers = DenseQuantizers.from_recipe(recipe, module_path(self))
        return call_op(self, quantizers, functools.partial(
            dense, inputs, kernel, bias, contracting_dims=(axis, tuple(range(len(axis)))), quantizers=quantizers,
            precision=self.precision))

    def _flax_product(self, inputs, kernel, bias, axis, batch, features):
        """flax.linen.DenseGeneral's product with batch dims or a custom dot_general (high precision)."""
        n_b, n_a = len(batch), len(axis)
        dot = self.dot_general_cls() if self.dot_general_cls is not None else (self.dot_general or lax.dot_general)
        out = dot(inputs, kernel, ((axis, tuple(range(n_b, n_b + n_a))), (batch, tuple(range(n_b)))),
                  precision=self.precision)
        if bias is not None:
            expanded = tuple(inputs.shape[a] if a in batch else 1 for a in range(inputs.ndim) if a not in axis)
            out = out + jnp.reshape(bias, expanded + features)
        return out


class Dense(nn.Module):
    """flax.linen.Dense whose GEMMs run in FP8 under te_jax.autocast.

    flax's name (auto-named "Dense_0"), arguments and parameters ("kernel"
    ``[in, features]``, "bias" ``[features]``, the same initializers called
    with the same shapes), so swapping ``nn.Dense`` for it loads a flax
    checkpoint unchanged; without autocast it computes what flax computes, bit
    for bit. Under ``te_jax.autocast(recipe=...)`` it calls ``te_jax.dense``
    (state in ``fp8_meta/<path>/<role>``, as ``DenseGeneral``).

    Attributes:
      features, use_bias, dtype, param_dtype, precision, kernel_init, bias_init, promote_dtype: flax's.
      kernel_axes, bias_axes: logical axis names (``nn.with_logical_partitioning``); () for none.
      dot_general, dot_general_cls: flax's custom products, honoured without autocast only.
    """

    features: int
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: Any = None
    kernel_init: C.Initializer = nn.initializers.lecun_normal()
    bias_init: C.Initializer = nn.initializers.zeros_init()
    promote_dtype: Any = promote_dtype
    dot_general: Any = None
    dot_general_cls: Any = None
    kernel_axes: tuple[str | None, ...] = ()
    bias_axes: tuple[str | None, ...] = ()

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs @ kernel + bias`` over the last axis."""
        C.check_dtypes(self)
        kernel = C.param(self, "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype,
                         self.kernel_axes)
        bias = C.param(self, "bias", self.bias_init, (self.features,), self.param_dtype,
                       self.bias_axes) if self.use_bias else None
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        C.check_dtypes(self, inputs)
        recipe = C.recipe_of_dense(self)
        if recipe is None:  # flax.linen.Dense's product, as flax writes it
            dot = self.dot_general_cls() if self.dot_general_cls is not None else (self.dot_general or lax.dot_general)
            y = dot(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision)
            if bias is not None:
                y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
            return y
        quantizers = DenseQuantizers.from_recipe(recipe, module_path(self))
        return call_op(self, quantizers, functools.partial(
            dense, inputs, kernel, bias, contracting_dims=((-1,), (0,)), quantizers=quantizers,
            precision=self.precision))
