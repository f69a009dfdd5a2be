"""``Linear`` and ``LinearGeneral``: flax.nnx's namesakes whose GEMMs run in FP8 under ``te_jax.autocast``."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes, initializers
from jax import lax

from te_jax.core import DenseQuantizers
from te_jax.core.layer_support import canonical_axes, check_dtypes
from te_jax.core.dense import dense
from te_jax.nnx._fp8 import Layer, call_quantizers, init_fp8, recipe_or_none, run_op, where
from te_jax.nnx._product import flat_operands

Dtype = Any
default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()


def _as_tuple(x: int | Sequence[int]) -> tuple[int, ...]:
    return (int(x),) if isinstance(x, (int, np.integer)) else tuple(int(d) for d in x)


def reshaped_init(init, shape_of_flat):
    """``init`` drawn at ``shape_of_flat(shape)`` and reshaped to ``shape`` (metadata kept), as flax.nnx's
    LinearGeneral initializes its kernel and bias."""

    def wrapped(rng, shape, dtype):
        value = init(rng, shape_of_flat(shape), dtype)
        if isinstance(value, nnx.VariableMetadata):
            value.raw_value = jnp.reshape(value.raw_value, shape)
            return value
        return jnp.reshape(value, shape)

    return wrapped


class _Dense(Layer):
    """What Linear and LinearGeneral share: FP8 state at construction, the call on ``te_jax.dense``."""

    def _init_fp8(self, rngs: nnx.Rngs, path) -> None:
        self.set_path(path)
        init_fp8(self, rngs)

    def fp8_quantizers(self, recipe) -> DenseQuantizers:
        return DenseQuantizers.from_recipe(recipe, self.path or ())

    def _product(self, inputs, axis: tuple[int, ...], custom: bool, flax_product, out_sharding=None):
        """``te_jax.dense`` over ``axis``, or flax.nnx's own product (``flax_product()``) when ``custom``.

        Under autocast the result is resharded to ``out_sharding`` as flax's ``dot_general(...,
        out_sharding=...)`` types it (the bias added after, as flax adds it, changes no sharding)."""
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        recipe = recipe_or_none()
        if custom:
            if recipe is not None:
                raise ValueError(f"te_jax: {where(self)}: a custom dot_general, batch_axis or "
                                 "preferred_element_type cannot be combined with te_jax.autocast (the quantized GEMMs "
                                 "have none of them); drop them or call outside autocast")
            return flax_product(inputs, kernel, bias)
        check_dtypes(where(self), x=inputs)  # float64 outside autocast only
        quantizers = call_quantizers(self)
        x, w, out_shape = inputs, kernel, None
        if quantizers.any:  # [..., K] @ [K, N]: the matrices dense quantizes, reshaped as Explicit mesh axes allow
            x, w, out_shape = flat_operands(inputs, kernel, axis, tuple(range(len(axis))), where(self))
            bias = None if bias is None else bias.reshape(w.shape[1:])
            axis = (x.ndim - 1,)
        y = run_op(self, quantizers, functools.partial(
            dense, x, w, bias, contracting_dims=(axis, tuple(range(len(axis)))), quantizers=quantizers,
            precision=self.precision))
        y = y if out_shape is None else y.reshape(out_shape)
        return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)


class Linear(_Dense):
    """``flax.nnx.Linear`` (same arguments, parameters, initialization and, without autocast, result) on
    ``te_jax.dense``.

    Under ``te_jax.autocast(recipe=...)`` the forward, dgrad and wgrad GEMMs
    quantize with the recipe, the roles carrying ``path``. Constructed under
    an autocast whose recipe keeps state (delayed scaling), the layer holds
    it in ``fp8_meta`` (``te_jax.nnx.FP8Meta``); given an ``nnx.Rngs`` with
    a "quantize" stream, it keeps a fork of it for stochastic rounding.

    Args:
      in_features, out_features, use_bias, dtype, param_dtype, precision,
        kernel_init, bias_init, dot_general, promote_dtype,
        preferred_element_type, rngs, kernel_metadata, bias_metadata: as
        ``flax.nnx.Linear``. A custom ``dot_general`` or
        ``preferred_element_type`` is honoured outside autocast only; the
        call's ``out_sharding`` under autocast too (the result resharded).
      path: the module path the recipe's roles carry (a ``te_jax.recipe.CustomRecipe``
        may choose by it), e.g. ``"block/attention/out"``; it also names the layer in errors. Left out
        (None), the layer's path in the model, which ``te_jax.nnx.name_paths(model)`` gives it.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, precision: Any = None, kernel_init=default_kernel_init,
                 bias_init=default_bias_init, dot_general=lax.dot_general, promote_dtype=dtypes.promote_dtype,
                 preferred_element_type: Dtype | None = None, rngs: nnx.Rngs,
                 kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
                 bias_metadata: Mapping[str, Any] = MappingProxyType({}), path: str | Sequence[str] | None = None):
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype),
                                **kernel_metadata)
        self.bias: nnx.Param | None
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype), **bias_metadata)
        else:
            self.bias = nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.dot_general = dot_general
        self.promote_dtype = promote_dtype
        self.preferred_element_type = preferred_element_type
        self._init_fp8(rngs, path)

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        """``inputs @ kernel + bias`` over the last axis."""
        custom = self.dot_general is not lax.dot_general or self.preferred_element_type is not None
        if recipe_or_none() is None and out_sharding is not None:
            custom = True  # flax's own product honours it

        def flax_product(inputs, kernel, bias):
            kwargs = {"out_sharding": out_sharding}
            if self.preferred_element_type is not None:
                kwargs["preferred_element_type"] = self.preferred_element_type
            y = self.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision,
                                 **kwargs)
            return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))

        return self._product(inputs, (jnp.ndim(inputs) - 1,), custom, flax_product, out_sharding)


class LinearGeneral(_Dense):
    """``flax.nnx.LinearGeneral`` (same arguments, parameters, initialization and, without autocast, result)
    on ``te_jax.dense``.

    The kernel is ``[*batch, *in_features, *out_features]``; the contracted
    input axes are taken in ascending order, as flax.nnx takes them. Under
    autocast the GEMMs quantize as ``Linear``'s do; ``batch_axis``, a custom
    ``dot_general``/``dot_general_cls`` and ``preferred_element_type`` are
    honoured outside autocast only, ``out_sharding`` under autocast too.

    Args:
      in_features, out_features, axis, batch_axis, use_bias, dtype,
        param_dtype, kernel_init, bias_init, precision, promote_dtype,
        dot_general, dot_general_cls, preferred_element_type, rngs,
        kernel_metadata, bias_metadata: as ``flax.nnx.LinearGeneral``.
      path: the module path the recipe's roles carry (see ``Linear``).
    """

    def __init__(self, in_features: int | Sequence[int], out_features: int | Sequence[int], *,
                 axis: int | Sequence[int] = -1, batch_axis: Mapping[int, int] = MappingProxyType({}),
                 use_bias: bool = True, dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
                 kernel_init=default_kernel_init, bias_init=default_bias_init, precision: Any = None,
                 promote_dtype=dtypes.promote_dtype, dot_general=None, dot_general_cls=None,
                 preferred_element_type: Dtype | None = None, rngs: nnx.Rngs,
                 kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
                 bias_metadata: Mapping[str, Any] = MappingProxyType({}), path: str | Sequence[str] | None = None):
        self.in_features = _as_tuple(in_features)
        self.out_features = _as_tuple(out_features)
        self.axis = _as_tuple(axis)
        self.batch_axis = tuple((int(a), int(s)) for a, s in dict(batch_axis).items())
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.dot_general = dot_general
        self.dot_general_cls = dot_general_cls
        self.promote_dtype = promote_dtype
        self.preferred_element_type = preferred_element_type
        if len(self.in_features) != len(self.axis):
            raise ValueError(f"te_jax: LinearGeneral: in_features {self.in_features} and axis {self.axis} must have "
                             "the same length")
        batch_dims = tuple(a for a, _ in self.batch_axis)
        if batch_dims and set(batch_dims) != set(range(max(batch_dims) + 1)):
            raise ValueError(f"te_jax: LinearGeneral: batch_axis {batch_dims} must be consecutive leading axes "
                             "starting from 0")
        batch_shape = tuple(s for _, s in self.batch_axis)
        n_in = len(batch_shape) + len(self.in_features)
        flat_kernel = reshaped_init(kernel_init, lambda s: (int(np.prod(s[:n_in])), int(np.prod(s[n_in:]))))
        self.kernel = nnx.Param(flat_kernel(rngs.params(), (*batch_shape, *self.in_features, *self.out_features),
                                            param_dtype), **kernel_metadata)
        self.bias: nnx.Param | None
        if use_bias:
            flat_bias = reshaped_init(bias_init, lambda s: (int(np.prod(s)),))
            self.bias = nnx.Param(flat_bias(rngs.params(), (*batch_shape, *self.out_features), param_dtype),
                                  **bias_metadata)
        else:
            self.bias = nnx.data(None)
        self._init_fp8(rngs, path)

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        """Contracts ``axis`` of ``inputs`` with the kernel: ``[*batch, *other axes, *out_features]``."""
        ndim = jnp.ndim(inputs)
        axis = tuple(sorted(canonical_axes(self.axis, ndim, where(self))))
        batch = tuple(sorted(canonical_axes(tuple(a for a, _ in self.batch_axis), ndim, where(self), "batch_axis")))
        custom = bool(batch) or self.dot_general is not None or self.dot_general_cls is not None or \
            self.preferred_element_type is not None or (recipe_or_none() is None and out_sharding is not None)

        def flax_product(inputs, kernel, bias):
            n_b = len(batch)
            dot = self.dot_general_cls() if self.dot_general_cls is not None else (self.dot_general or lax.dot_general)
            kwargs = {"out_sharding": out_sharding}
            if self.preferred_element_type is not None:
                kwargs["preferred_element_type"] = self.preferred_element_type
            y = dot(inputs, kernel, ((axis, tuple(range(n_b, n_b + len(axis)))), (batch, tuple(range(n_b)))),
                    precision=self.precision, **kwargs)
            if bias is None:
                return y
            expanded = tuple(inputs.shape[a] if a in batch else 1 for a in range(ndim) if a not in axis)
            return y + jnp.reshape(bias, (*expanded, *self.out_features))

        return self._product(inputs, axis, custom, flax_product, out_sharding)
