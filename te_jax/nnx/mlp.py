"""``LayerNormMLP``: norm, first GEMM, activation, dropout, second GEMM on ``te_jax.layernorm_mlp``."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import initializers

from te_jax.core import GEMMS, MLPQuantizers
from te_jax.core.layer_support import activation_name, canonical_input, check_dtypes, compute_dtype, dropout_mask
from te_jax.core.layernorm_mlp import GATED, layernorm_mlp
from te_jax.nnx._fp8 import Layer, call_quantizers, init_fp8, run_op, where
from te_jax.nnx.linear import default_bias_init, default_kernel_init, reshaped_init
from te_jax.nnx.normalization import norm_args, norm_params, param

Dtype = Any


def dropout_rngs(rngs: nnx.Rngs | None, name: str, rate: float):
    """A fork of the stream ``name`` when dropout can draw a mask (as ``nnx.Dropout`` keeps one), else None."""
    if rate > 0.0 and rngs is not None:
        return rngs[name].fork()
    return nnx.data(None)


def dropout_key(layer: nnx.Module, rngs) -> jax.Array:
    """The key of a dropout mask: from the call's ``rngs`` (Rngs, RngStream or key), else the layer's stream."""
    rngs = rngs if rngs is not None else layer.dropout_rngs
    if rngs is None:
        raise ValueError(f"te_jax: {where(layer)}: dropout is active (deterministic=False) but no rngs were given; "
                         "pass rngs= at construction or call, or set deterministic=True (model.eval())")
    if isinstance(rngs, nnx.Rngs):
        return rngs[layer.dropout_rng_name]()
    if isinstance(rngs, nnx.RngStream):
        return rngs()
    return rngs


class LayerNormMLP(Layer):
    """``wo(dropout(act(wi(norm(x)))))`` on ``te_jax.layernorm_mlp``: ``te_jax.flax.LayerNormMLP`` in NNX form.

    Parameters (drawn in this order): "scale", "ln_bias" ``[H]``;
    "wi_kernel" ``[H, F]`` (gated activations: ``[H, 2, F]``, activated half
    first), "wi_bias" ``[F]`` / ``[2, F]``; "wo_kernel" ``[F, H]``,
    "wo_bias" ``[H]``. Without autocast it computes flax's ``LayerNorm`` ->
    ``Linear`` -> activation -> ``Linear`` (gelu is the tanh
    approximation); under autocast both GEMMs quantize, their roles carrying
    the paths ``<path>/wi`` and ``<path>/wo``, and delayed-scaling state is
    ``fp8_meta == {"wi": {role: state}, "wo": {...}}``.

    Args:
      in_features: H.
      intermediate_dim: F.
      activation: "gelu", "relu", "silu", "squared_relu", "swiglu", "geglu"
        (or a TE tuple such as ("silu", "linear")).
      enable_layernorm, layernorm_type, zero_centered_gamma, epsilon,
        use_scale, scale_init, use_ln_bias, ln_bias_init: the norm (as ``LayerNormLinear``).
      use_bias: biases on both GEMMs.
      kernel_init, bias_init: initializers (kernels see flattened 2D shapes).
      intermediate_dropout_rate: dropout on the activation output.
      intermediate_hidden_dropout_dims: axes of the activation output that share a dropout mask.
      dropout_rng_name: the ``nnx.Rngs`` stream of the dropout mask.
      deterministic: no dropout (``model.eval()`` sets it, ``model.train()`` clears it).
      dtype, param_dtype, precision: as ``flax.nnx.Linear``.
      kernel_axes_1, kernel_axes_2, bias_axes_1, bias_axes_2, scale_axes,
        ln_bias_axes: logical axis names of the parameters.
      rngs: ``params`` draws the parameters; a "quantize" stream gives stochastic-rounding keys.
      path: the module path the recipe's roles carry (see ``te_jax.nnx.Linear``).
    """

    fp8_gemms = GEMMS

    def __init__(self, in_features: int, intermediate_dim: int = 2048, *, activation: str | Sequence[str] = "gelu",
                 enable_layernorm: bool = True, layernorm_type: str = "layernorm", zero_centered_gamma: bool = False,
                 epsilon: float = 1e-6, use_scale: bool = True, scale_init=None, use_ln_bias: bool | None = None,
                 ln_bias_init=initializers.zeros_init(), use_bias: bool = True, kernel_init=default_kernel_init,
                 bias_init=default_bias_init, intermediate_dropout_rate: float = 0.0,
                 intermediate_hidden_dropout_dims: Sequence[int] = (), dropout_rng_name: str = "dropout",
                 deterministic: bool = False, dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
                 precision: Any = None, kernel_axes_1: Sequence[str | None] = (),
                 kernel_axes_2: Sequence[str | None] = (), bias_axes_1: Sequence[str | None] = (),
                 bias_axes_2: Sequence[str | None] = (), scale_axes: Sequence[str | None] = (),
                 ln_bias_axes: Sequence[str | None] = (), rngs: nnx.Rngs, path: str | Sequence[str] | None = None):
        self.set_path(path)
        check_dtypes(where(self), dtype, param_dtype)
        self.activation = activation_name(activation, where(self))
        h, f = int(in_features), int(intermediate_dim)
        if f < 1:
            raise ValueError(f"te_jax: {where(self)}: intermediate_dim must be >= 1, got {intermediate_dim}")
        self.scale = self.ln_bias = nnx.data(None)
        if enable_layernorm:
            self.scale, self.ln_bias = norm_params(
                self, h, rngs, layernorm_type=layernorm_type, zero_centered_gamma=zero_centered_gamma,
                use_scale=use_scale, scale_init=scale_init, use_bias=use_ln_bias, bias_init=ln_bias_init,
                param_dtype=param_dtype, scale_axes=scale_axes, bias_axes=ln_bias_axes)
        wi_features = (2, f) if self.activation in GATED else (f,)
        flat_kernel = reshaped_init(kernel_init, lambda s: (s[0], int(np.prod(s[1:]))))
        flat_bias = reshaped_init(bias_init, lambda s: (int(np.prod(s)),))
        self.wi_kernel = param(flat_kernel, rngs, (h, *wi_features), param_dtype, kernel_axes_1)
        self.wi_bias = param(flat_bias, rngs, wi_features, param_dtype, bias_axes_1) if use_bias else nnx.data(None)
        self.wo_kernel = param(kernel_init, rngs, (f, h), param_dtype, kernel_axes_2)
        self.wo_bias = param(bias_init, rngs, (h,), param_dtype, bias_axes_2) if use_bias else nnx.data(None)
        self.in_features, self.intermediate_dim = h, f
        self.enable_layernorm, self.layernorm_type = enable_layernorm, layernorm_type
        self.zero_centered_gamma, self.epsilon = zero_centered_gamma, epsilon
        self.intermediate_dropout_rate = intermediate_dropout_rate
        self.intermediate_hidden_dropout_dims = tuple(intermediate_hidden_dropout_dims)
        self.dropout_rng_name, self.deterministic = dropout_rng_name, deterministic
        self.dropout_rngs = dropout_rngs(rngs, dropout_rng_name, intermediate_dropout_rate)
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        init_fp8(self, rngs)

    def fp8_quantizers(self, recipe) -> MLPQuantizers:
        return MLPQuantizers.from_recipe(recipe, self.path or ())

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None, rngs=None) -> jax.Array:
        """``[..., H] -> [..., H]``.

        Args:
          x: the input.
          deterministic: overrides the layer's ``deterministic`` (True: no dropout).
          rngs: the dropout mask's ``nnx.Rngs``, ``RngStream`` or key (default: the layer's).
        """
        x = canonical_input(x)
        check_dtypes(where(self), x=x)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"te_jax: {where(self)}: the input's last axis is {x.shape[-1]}, in_features is "
                             f"{self.in_features}")
        scale = self.scale[...] if self.scale is not None else None
        ln_bias = self.ln_bias[...] if self.ln_bias is not None else None
        k1, k2 = self.wi_kernel[...], self.wo_kernel[...]
        b1 = self.wi_bias[...] if self.wi_bias is not None else None
        b2 = self.wo_bias[...] if self.wo_bias is not None else None
        gamma, beta, zcg, kind = None, None, False, None
        if self.enable_layernorm:
            gamma, beta, zcg = norm_args(x, scale, ln_bias, self.zero_centered_gamma)
            kind = self.layernorm_type
        dtype = compute_dtype(self.dtype, x, scale, ln_bias, k1, b1, k2, b2)
        check_dtypes(where(self), dtype)
        k1, k2 = k1.astype(dtype), k2.astype(dtype)
        b1, b2 = (None if b is None else b.astype(dtype) for b in (b1, b2))
        if not self.enable_layernorm:
            x = x.astype(dtype)
        deterministic = self.deterministic if deterministic is None else deterministic
        mask = dropout_mask(lambda: dropout_key(self, rngs), self.intermediate_dropout_rate,
                            (*x.shape[:-1], self.intermediate_dim), self.intermediate_hidden_dropout_dims, dtype,
                            deterministic, where(self))
        quantizers = call_quantizers(self)
        return run_op(self, quantizers, functools.partial(
            layernorm_mlp, x, gamma, beta, k1, b1, k2, b2, activation=self.activation, norm_type=kind,
            zero_centered_gamma=zcg, epsilon=self.epsilon, dropout_mask=mask, quantizers=quantizers,
            precision=self.precision))
