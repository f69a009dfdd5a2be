"""``LayerNorm`` (layernorm / rmsnorm) and ``LayerNormDenseGeneral`` (norm fused into the GEMM input's cast)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from te_jax.core import DenseQuantizers
from te_jax.core.gemm_quant import NormSpec, normalize_hp
from te_jax.core.layer_support import flax_normalize
from te_jax.core.layernorm_dense import layernorm_dense
from te_jax.flax import _common as C
from te_jax.flax._common import call_op, gemm_norm_params, norm_params
from te_jax.flax._common import module_path

Dtype = Any


class LayerNorm(nn.Module):
    """Layer normalization (or RMS normalization) over the last axis, on the fused norm kernels.

    Accepts ``flax.linen.LayerNorm``'s arguments and call (``mask``
    included); parameters "scale" and "bias" ``[H]``. Outside autocast it
    computes exactly what ``flax.linen.LayerNorm`` computes
    (``layernorm_type="rmsnorm"``: ``flax.linen.RMSNorm``), operation for
    operation, honouring ``use_fast_variance`` and ``force_float32_reductions``
    and promoting NumPy float64 and integer inputs as flax does;
    ``zero_centered_gamma`` scales by ``1 + scale``. Under an enabled
    ``te_jax.autocast`` (nothing here is quantized) it runs te_jax's fused
    norm kernel: float32, two-pass statistics, within a few float32 ulps of
    flax; a call with ``mask`` keeps flax's computation there too (the fused
    kernel has no mask).

    Attributes:
      epsilon: added to the variance.
      dtype: the output dtype (default: promoted from input and params).
      param_dtype: the parameters' dtype.
      use_bias: add a bias (None: True for layernorm; rmsnorm has none).
      use_scale: multiply by a learned scale.
      bias_init, scale_init: initializers (scale_init None: ones, zeros with zero-centred gamma).
      reduction_axes, feature_axes: must be the last axis.
      axis_name, axis_index_groups: not supported (must be None).
      layernorm_type: "layernorm" or "rmsnorm".
      zero_centered_gamma: scale by ``1 + scale``.
      scale_axes, bias_axes: logical axis names of the parameters.
    """

    epsilon: float = 1e-6
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    use_bias: bool | None = None
    use_scale: bool = True
    bias_init: C.Initializer = nn.initializers.zeros
    scale_init: C.Initializer | None = None
    reduction_axes: Any = -1
    feature_axes: Any = -1
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    scale_axes: tuple[str | None, ...] = ()
    bias_axes: tuple[str | None, ...] = ()

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalizes over the last axis; ``mask`` (broadcastable to ``x``) selects the elements the statistics read."""
        C.check_dtypes(self)
        x = jnp.asarray(x)
        last = (x.ndim - 1,)
        for name in ("reduction_axes", "feature_axes"):
            if C.canonical_axes(getattr(self, name), x.ndim, self, name) != last:
                raise ValueError(f"te_jax: {C.where(self)}: {name} must be the last axis (-1), got "
                                 f"{getattr(self, name)}")
        if self.axis_name is not None or self.axis_index_groups is not None:
            raise ValueError(f"te_jax: {C.where(self)}: axis_name / axis_index_groups are not supported; under jit "
                             "with sharded inputs the statistics are global already")
        gamma, beta, zcg = norm_params(self, x, layernorm_type=self.layernorm_type,
                                       zero_centered_gamma=self.zero_centered_gamma, use_scale=self.use_scale,
                                       use_bias=self.use_bias, scale_init=self.scale_init, bias_init=self.bias_init,
                                       scale_axes=self.scale_axes, bias_axes=self.bias_axes, bias_name="bias")
        dtype = C.compute_dtype(self.dtype, x, gamma if self.use_scale else None, beta)
        C.check_dtypes(self, jnp.zeros((), dtype))
        if C.recipe_or_none() is not None and mask is None:
            x = C.canonical_input(x)
            return normalize_hp(NormSpec(self.layernorm_type, zcg, float(self.epsilon)), x, gamma, beta, dtype)
        return flax_normalize(x, gamma if self.use_scale else None, beta, layernorm_type=self.layernorm_type,
                              zero_centered_gamma=zcg, epsilon=self.epsilon, use_fast_variance=self.use_fast_variance,
                              force_float32_reductions=self.force_float32_reductions, reduction_dtype=self.dtype,
                              param_dtype=self.param_dtype, dtype=dtype, mask=mask)


class LayerNormDenseGeneral(nn.Module):
    """``DenseGeneral(LayerNorm(x))`` with the norm writing the GEMM's quantized input.

    Parameters: "scale" and "ln_bias" ``[H]`` (the norm), "kernel"
    ``[*in axes, *features]`` and "bias" ``features`` (the dense layer), so a
    flax.linen ``LayerNorm`` + ``DenseGeneral`` pair moves over by renaming
    the norm's "bias" to "ln_bias". Without autocast it computes what that
    pair computes. Under autocast it calls ``te_jax.layernorm_dense``.

    Attributes:
      features: int or tuple of output features.
      axis: the contracted axes: the last axis with a norm; any trailing axes
        without (``enable_layernorm=False``, e.g. ``(-2, -1)`` for an
        attention output projection).
      enable_layernorm: normalize first (False: a DenseGeneral on trailing axes).
      layernorm_type, zero_centered_gamma, epsilon, use_scale, scale_init,
        ln_bias_init, use_ln_bias: the norm (as ``LayerNorm``).
      use_bias, kernel_init, bias_init, dtype, param_dtype, precision: as ``flax.linen.DenseGeneral``.
      kernel_axes, bias_axes, scale_axes, ln_bias_axes: logical axis names.
      dot_general_cls: as ``flax.linen.DenseGeneral``'s (e.g. ``nn.Fp8DirectDotGeneralOp``), for the
        unquantized path only: under a te_jax recipe the quantized GEMMs replace it.
      recompute_norm_act: with the norm, the backward recomputes its output (FP8 copy) from the input it
        keeps, instead of keeping it; without, it keeps x and quantizes it again, which saves memory only
        where x is kept anyway (an attention output under cuDNN: ``SelfAttention``) (``te_jax.layernorm_dense``).
    """

    features: int | Sequence[int]
    axis: int | Sequence[int] = -1
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    epsilon: float = 1e-6
    use_scale: bool = True
    scale_init: C.Initializer | None = None
    use_ln_bias: bool | None = None
    ln_bias_init: C.Initializer = nn.initializers.zeros
    use_bias: bool = True
    kernel_init: C.Initializer = nn.initializers.lecun_normal()
    bias_init: C.Initializer = nn.initializers.zeros_init()
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: Any = None
    kernel_axes: tuple[str | None, ...] = ()
    bias_axes: tuple[str | None, ...] = ()
    scale_axes: tuple[str | None, ...] = ()
    ln_bias_axes: tuple[str | None, ...] = ()
    dot_general_cls: Any = None
    recompute_norm_act: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        C.check_dtypes(self, x := C.canonical_input(x))
        features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        axis = C.canonical_axes(self.axis, x.ndim, self)
        n_in = len(axis)
        if axis != tuple(range(x.ndim - n_in, x.ndim)) or (self.enable_layernorm and n_in != 1):
            raise ValueError(f"te_jax: {C.where(self)}: axis={self.axis} must be the last axis (with a norm) or "
                             "trailing axes (enable_layernorm=False)")
        in_shape = x.shape[x.ndim - n_in:]
        gamma, beta, zcg, kind = gemm_norm_params(self, x)
        kernel = C.param(self, "kernel", C.flat_init(self.kernel_init, n_in), in_shape + features, self.param_dtype,
                         self.kernel_axes)
        bias = C.param(self, "bias", C.flat_bias_init(self.bias_init), features, self.param_dtype,
                       self.bias_axes) if self.use_bias else None
        dtype = C.compute_dtype(self.dtype, x, gamma if self.use_scale else None, beta, kernel, bias)
        C.check_dtypes(self, jnp.zeros((), dtype))
        kernel = kernel.astype(dtype).reshape(int(np.prod(in_shape)), *features)
        bias = None if bias is None else bias.astype(dtype)
        x = x.reshape(*x.shape[:x.ndim - n_in], int(np.prod(in_shape))) if n_in > 1 else x
        if not self.enable_layernorm:
            x = x.astype(dtype)
        quantizers = DenseQuantizers.from_recipe(C.recipe_or_none(), module_path(self))
        return call_op(self, quantizers, functools.partial(
            layernorm_dense, x, gamma, beta, kernel, bias, norm_type=kind, zero_centered_gamma=zcg,
            epsilon=self.epsilon, quantizers=quantizers, precision=self.precision,
            dot_general=C.dot_general_of(self, self.dot_general_cls, quantizers.any),
            recompute_norm_act=self.recompute_norm_act))
