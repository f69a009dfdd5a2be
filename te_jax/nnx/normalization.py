"""``LayerNorm``, ``RMSNorm`` (flax.nnx's namesakes on the fused norm kernels) and ``LayerNormLinear``."""

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

from te_jax.core import DenseQuantizers
from te_jax.core.gemm_quant import NormSpec, normalize_hp
from te_jax.core.layer_support import canonical_axes, canonical_input, check_dtypes, compute_dtype, flax_normalize, \
    norm_uses_bias
from te_jax.core.layernorm_dense import layernorm_dense
from te_jax.nnx._fp8 import Layer, call_quantizers, init_fp8, recipe_or_none, run_op, where
from te_jax.nnx.linear import default_bias_init, default_kernel_init, reshaped_init

Dtype = Any
NO_METADATA = MappingProxyType({})


def param(init, rngs: nnx.Rngs, shape: Sequence[int], dtype, axes: Sequence[str | None] = (),
          metadata: Mapping[str, Any] = NO_METADATA) -> nnx.Param:
    """An ``nnx.Param`` drawn from ``rngs.params()``, with the logical axis names ``axes`` as its sharding."""
    meta = dict(metadata)
    if axes:
        if len(axes) != len(shape):
            raise ValueError(f"te_jax: a parameter of shape {tuple(shape)} got {len(axes)} axis names {tuple(axes)}")
        meta["out_sharding"] = tuple(axes)
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), **meta)


def norm_params(layer: nnx.Module, h: int, rngs: nnx.Rngs, *, layernorm_type: str, zero_centered_gamma: bool,
                use_scale: bool, scale_init, use_bias: bool | None, bias_init, param_dtype, scale_axes=(),
                bias_axes=(), scale_metadata=NO_METADATA, bias_metadata=NO_METADATA) -> tuple:
    """The norm's ``(scale, bias)`` parameters (None where absent), drawn in that order as flax.nnx's LayerNorm."""
    use_bias = norm_uses_bias(layernorm_type, use_bias, where(layer))
    scale = bias = nnx.data(None)
    if use_scale:
        init = scale_init if scale_init is not None else (initializers.zeros_init() if zero_centered_gamma else
                                                          initializers.ones_init())
        scale = param(init, rngs, (h,), param_dtype, scale_axes, scale_metadata)
    if use_bias:
        bias = param(bias_init, rngs, (h,), param_dtype, bias_axes, bias_metadata)
    return scale, bias


def norm_args(x: jax.Array, scale, bias, zero_centered_gamma: bool):
    """``(gamma, beta, zero_centered_gamma)`` as the fused kernels take them (``[H]`` arrays)."""
    if scale is None:
        return jnp.ones((x.shape[-1],), jnp.float32), bias, False
    return scale, bias, bool(zero_centered_gamma)


class _Norm(Layer):
    """LayerNorm and RMSNorm: flax.nnx's computation without autocast, the fused kernel under it."""

    layernorm_type = "layernorm"

    def __init__(self, num_features: int, *, epsilon: float, dtype, param_dtype, use_bias: bool | None,
                 use_scale: bool, bias_init, scale_init, reduction_axes, feature_axes, axis_name, axis_index_groups,
                 use_fast_variance: bool, promote_dtype, zero_centered_gamma: bool, rngs: nnx.Rngs,
                 bias_metadata, scale_metadata):
        self.set_path(None)
        check_dtypes(where(self), dtype, param_dtype)
        if axis_name is not None or axis_index_groups is not None:
            raise ValueError(f"te_jax: {where(self)}: axis_name / axis_index_groups are not supported; under jit with "
                             "sharded inputs the statistics are global already")
        self.scale, self.bias = norm_params(
            self, num_features, rngs, layernorm_type=self.layernorm_type, zero_centered_gamma=zero_centered_gamma,
            use_scale=use_scale, scale_init=scale_init, use_bias=use_bias, bias_init=bias_init,
            param_dtype=param_dtype, scale_metadata=scale_metadata, bias_metadata=bias_metadata)
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_bias = self.bias is not None
        self.use_scale = use_scale
        self.reduction_axes = reduction_axes
        self.feature_axes = feature_axes
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype
        self.zero_centered_gamma = zero_centered_gamma

    def _normalize(self, x, mask):
        x = canonical_input(x)
        last = (x.ndim - 1,)
        for name in ("reduction_axes", "feature_axes"):
            if canonical_axes(getattr(self, name), x.ndim, where(self), name) != last:
                raise ValueError(f"te_jax: {where(self)}: {name} must be the last axis (-1), got "
                                 f"{getattr(self, name)}")
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        if recipe_or_none() is not None and mask is None:
            dtype = compute_dtype(self.dtype, x, scale, bias)
            check_dtypes(where(self), dtype, None, x)
            gamma, beta, zcg = norm_args(x, scale, bias, self.zero_centered_gamma)
            return normalize_hp(NormSpec(self.layernorm_type, zcg, float(self.epsilon)), x, gamma, beta, dtype)
        if self.layernorm_type == "rmsnorm":  # flax.nnx's RMSNorm promotes (x, scale)
            x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        else:
            x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        return flax_normalize(x, scale, bias, layernorm_type=self.layernorm_type,
                              zero_centered_gamma=self.zero_centered_gamma and scale is not None,
                              epsilon=self.epsilon, use_fast_variance=self.use_fast_variance,
                              force_float32_reductions=True, reduction_dtype=self.dtype, param_dtype=self.param_dtype,
                              dtype=compute_dtype(self.dtype, x, scale, bias), mask=mask)


class LayerNorm(_Norm):
    """``flax.nnx.LayerNorm`` over the last axis: same arguments, parameters and, without autocast, result.

    Under an enabled ``te_jax.autocast`` (nothing here is quantized) it runs
    te_jax's fused norm kernel (float32, two-pass statistics, within a few
    float32 ulps of flax); a call with ``mask`` keeps flax's computation.

    Args:
      num_features, epsilon, dtype, param_dtype, use_bias, use_scale,
        bias_init, scale_init, use_fast_variance, promote_dtype, rngs,
        bias_metadata, scale_metadata: as ``flax.nnx.LayerNorm`` (scale_init
        None: ones, or zeros with ``zero_centered_gamma``).
      reduction_axes, feature_axes: must be the last axis.
      axis_name, axis_index_groups: not supported (must be None).
      zero_centered_gamma: scale by ``1 + scale``.
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, use_bias: bool = True, use_scale: bool = True,
                 bias_init=initializers.zeros_init(), scale_init=None, reduction_axes=-1, feature_axes=-1,
                 axis_name: str | None = None, axis_index_groups: Any = None, use_fast_variance: bool = True,
                 promote_dtype=dtypes.promote_dtype, zero_centered_gamma: bool = False, rngs: nnx.Rngs,
                 bias_metadata: Mapping[str, Any] = NO_METADATA, scale_metadata: Mapping[str, Any] = NO_METADATA):
        super().__init__(num_features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, use_bias=use_bias,
                         use_scale=use_scale, bias_init=bias_init, scale_init=scale_init,
                         reduction_axes=reduction_axes, feature_axes=feature_axes, axis_name=axis_name,
                         axis_index_groups=axis_index_groups, use_fast_variance=use_fast_variance,
                         promote_dtype=promote_dtype, zero_centered_gamma=zero_centered_gamma, rngs=rngs,
                         bias_metadata=bias_metadata, scale_metadata=scale_metadata)

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalizes over the last axis; ``mask`` (broadcastable to ``x``) selects the elements the statistics read."""
        return self._normalize(x, mask)


class RMSNorm(_Norm):
    """``flax.nnx.RMSNorm`` over the last axis: same arguments, parameter and, without autocast, result.

    Under an enabled ``te_jax.autocast`` it runs the fused norm kernel, as ``LayerNorm`` does.

    Args:
      num_features, epsilon, dtype, param_dtype, use_scale, scale_init,
        use_fast_variance, promote_dtype, rngs, scale_metadata: as ``flax.nnx.RMSNorm``.
      reduction_axes, feature_axes: must be the last axis.
      axis_name, axis_index_groups: not supported (must be None).
      zero_centered_gamma: scale by ``1 + scale``.
    """

    layernorm_type = "rmsnorm"

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, use_scale: bool = True, scale_init=None, reduction_axes=-1,
                 feature_axes=-1, axis_name: str | None = None, axis_index_groups: Any = None,
                 use_fast_variance: bool = True, promote_dtype=dtypes.promote_dtype, zero_centered_gamma: bool = False,
                 rngs: nnx.Rngs, scale_metadata: Mapping[str, Any] = NO_METADATA):
        super().__init__(num_features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, use_bias=False,
                         use_scale=use_scale, bias_init=None, scale_init=scale_init, reduction_axes=reduction_axes,
                         feature_axes=feature_axes, axis_name=axis_name, axis_index_groups=axis_index_groups,
                         use_fast_variance=use_fast_variance, promote_dtype=promote_dtype,
                         zero_centered_gamma=zero_centered_gamma, rngs=rngs, bias_metadata=NO_METADATA,
                         scale_metadata=scale_metadata)

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """Normalizes by the root mean square over the last axis (``mask``: the elements the statistics read)."""
        return self._normalize(x, mask)


class LayerNormLinear(Layer):
    """``LinearGeneral(LayerNorm(x))`` with the norm writing the GEMM's quantized input (``te_jax.layernorm_dense``).

    ``te_jax.flax.LayerNormDenseGeneral`` in NNX form. Parameters "scale",
    "ln_bias" ``[H]`` (the norm, drawn first), "kernel" ``[*in_features,
    *out_features]`` and "bias" ``out_features``, initialized as flax.nnx's
    ``LayerNorm`` followed by ``LinearGeneral`` initializes them. Without
    autocast it computes what that pair computes, up to the fused norm's
    float32 rounding.

    Args:
      in_features: H, or with ``enable_layernorm=False`` a tuple of the
        trailing axes' sizes (e.g. ``(heads, head_dim)`` with ``axis=(-2, -1)``).
      out_features: int or tuple of output features.
      axis: the contracted axes: the last axis with a norm, trailing axes without.
      enable_layernorm: normalize first.
      layernorm_type: "layernorm" or "rmsnorm".
      zero_centered_gamma, epsilon, use_scale, scale_init, use_ln_bias,
        ln_bias_init: the norm (as ``LayerNorm``; ``use_ln_bias`` None: rmsnorm has none).
      use_bias, kernel_init, bias_init, dtype, param_dtype, precision: as ``flax.nnx.LinearGeneral``.
      kernel_axes, bias_axes, scale_axes, ln_bias_axes: logical axis names
        of the parameters (their ``out_sharding``; ``nnx.get_partition_spec``).
      recompute_norm_act: the backward recomputes the GEMM input's FP8 copy (the norm's output; without
        a norm, x's) instead of keeping it (``te_jax.layernorm_dense``); ``__call__`` may override it.
      rngs: ``params`` draws the parameters; a "quantize" stream gives stochastic-rounding keys.
      path: the module path the recipe's roles carry (see ``te_jax.nnx.Linear``).
    """

    def __init__(self, in_features: int | Sequence[int], out_features: int | Sequence[int], *,
                 axis: int | Sequence[int] = -1, enable_layernorm: bool = True, layernorm_type: str = "layernorm",
                 zero_centered_gamma: bool = False, epsilon: float = 1e-6, use_scale: bool = True, scale_init=None,
                 use_ln_bias: bool | None = None, ln_bias_init=initializers.zeros_init(), use_bias: bool = True,
                 kernel_init=default_kernel_init, bias_init=default_bias_init, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, precision: Any = None, kernel_axes: Sequence[str | None] = (),
                 bias_axes: Sequence[str | None] = (), scale_axes: Sequence[str | None] = (),
                 ln_bias_axes: Sequence[str | None] = (), recompute_norm_act: bool = False, rngs: nnx.Rngs,
                 path: str | Sequence[str] | None = None):
        self.set_path(path)
        check_dtypes(where(self), dtype, param_dtype)
        in_shape = (in_features,) if isinstance(in_features, (int, np.integer)) else tuple(in_features)
        features = (out_features,) if isinstance(out_features, (int, np.integer)) else tuple(out_features)
        n_axis = 1 if isinstance(axis, (int, np.integer)) else len(tuple(axis))
        if n_axis != len(in_shape) or (enable_layernorm and n_axis != 1):
            raise ValueError(f"te_jax: {where(self)}: axis={axis} must be the last axis (with a norm) or trailing "
                             f"axes (enable_layernorm=False), one per in_features {in_shape}")
        self.scale = self.ln_bias = nnx.data(None)
        if enable_layernorm:
            self.scale, self.ln_bias = norm_params(
                self, in_shape[0], rngs, layernorm_type=layernorm_type, zero_centered_gamma=zero_centered_gamma,
                use_scale=use_scale, scale_init=scale_init, use_bias=use_ln_bias, bias_init=ln_bias_init,
                param_dtype=param_dtype, scale_axes=scale_axes, bias_axes=ln_bias_axes)
        n_in = len(in_shape)
        self.kernel = param(reshaped_init(kernel_init, lambda s: (int(np.prod(s[:n_in])), int(np.prod(s[n_in:])))),
                            rngs, in_shape + features, param_dtype, kernel_axes)
        self.bias = nnx.data(None)
        if use_bias:
            self.bias = param(reshaped_init(bias_init, lambda s: (int(np.prod(s)),)), rngs, features, param_dtype,
                              bias_axes)
        self.in_features, self.out_features, self.axis = in_shape, features, axis
        self.enable_layernorm, self.layernorm_type = enable_layernorm, layernorm_type
        self.zero_centered_gamma, self.epsilon = zero_centered_gamma, epsilon
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.recompute_norm_act = recompute_norm_act
        init_fp8(self, rngs)

    def fp8_quantizers(self, recipe) -> DenseQuantizers:
        return DenseQuantizers.from_recipe(recipe, self.path or ())

    def __call__(self, x: jax.Array, *, recompute_norm_act: bool | None = None) -> jax.Array:
        """``[..., *in_features] -> [..., *out_features]``; ``recompute_norm_act`` None: the layer's."""
        x = canonical_input(x)
        check_dtypes(where(self), x=x)
        n_in = len(self.in_features)
        axis = canonical_axes(self.axis, x.ndim, where(self))
        if axis != tuple(range(x.ndim - n_in, x.ndim)) or x.shape[x.ndim - n_in:] != self.in_features:
            raise ValueError(f"te_jax: {where(self)}: the input {x.shape} must end in in_features {self.in_features} "
                             f"(axis={self.axis})")
        scale = self.scale[...] if self.scale is not None else None
        ln_bias = self.ln_bias[...] if self.ln_bias is not None else None
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        gamma, beta, zcg, kind = None, None, False, None
        if self.enable_layernorm:
            gamma, beta, zcg = norm_args(x, scale, ln_bias, self.zero_centered_gamma)
            kind = self.layernorm_type
        dtype = compute_dtype(self.dtype, x, scale, ln_bias, kernel, bias)
        check_dtypes(where(self), dtype)
        kernel = kernel.astype(dtype).reshape(int(np.prod(self.in_features)), *self.out_features)
        bias = None if bias is None else bias.astype(dtype)
        x = x.reshape(*x.shape[:x.ndim - n_in], int(np.prod(self.in_features))) if n_in > 1 else x
        if not self.enable_layernorm:
            x = x.astype(dtype)
        quantizers = call_quantizers(self)
        return run_op(self, quantizers, functools.partial(
            layernorm_dense, x, gamma, beta, kernel, bias, norm_type=kind, zero_centered_gamma=zcg,
            epsilon=self.epsilon, quantizers=quantizers, precision=self.precision,
            recompute_norm_act=self.recompute_norm_act if recompute_norm_act is None else recompute_norm_act))
