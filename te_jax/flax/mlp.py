"""``LayerNormMLP``: norm, first GEMM, activation, dropout, second GEMM, with every cast fused."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax.core import GEMMS, MLPQuantizers
from te_jax.core.layer_support import activation_name
from te_jax.core.layernorm_mlp import GATED, layernorm_mlp
from te_jax.flax import _common as C
from te_jax.flax._common import call_op, gemm_norm_params
from te_jax.flax._common import module_path

Dtype = Any
class LayerNormMLP(nn.Module):
    """``wo(dropout(act(wi(norm(x)))))`` on ``te_jax.layernorm_mlp``.

    Parameters: "scale", "ln_bias" ``[H]``; "wi_kernel" ``[H, F]`` (gated
    activations: ``[H, 2, F]``, activated half first), "wi_bias" ``[F]`` /
    ``[2, F]``; "wo_kernel" ``[F, H]``, "wo_bias" ``[H]``. Without autocast it
    computes flax.linen's ``LayerNorm`` -> ``Dense`` -> activation -> ``Dense``
    (gelu is the tanh approximation, ``nn.gelu``'s default). Under autocast
    both GEMMs quantize with the recipe, their roles carrying the paths
    ``<path>/wi`` and ``<path>/wo``; delayed-scaling state lives in
    ``fp8_meta/<path>/wi/<role>`` and ``.../wo/<role>``.

    Attributes:
      intermediate_dim: F.
      activation: "gelu", "relu", "silu", "squared_relu", "swiglu", "geglu"
        (or a TE tuple such as ("silu", "linear")).
      enable_layernorm, layernorm_type, zero_centered_gamma, epsilon, use_scale,
        scale_init, use_ln_bias, ln_bias_init: the norm (as ``LayerNorm``).
      use_bias: biases on both GEMMs.
      kernel_init, bias_init: initializers (kernels see flattened 2D shapes).
      intermediate_dropout_rate: dropout on the activation output.
      intermediate_hidden_dropout_dims: axes of the activation output that share a dropout mask.
      dropout_rng_name: the RNG stream of the dropout mask.
      dtype, param_dtype, precision: as flax.linen.Dense.
      kernel_axes_1, kernel_axes_2, bias_axes_1, bias_axes_2, scale_axes,
        ln_bias_axes: logical axis names.
      dot_general_cls: as ``flax.linen.Dense``'s, one instance per GEMM, for the unquantized path only.
      recompute_norm_act: the backward recomputes the norm's and the activation's outputs (their FP8
        copies) from the input and pre-activation it keeps, instead of keeping them
        (``te_jax.layernorm_mlp``): less memory, two fused kernels more in the backward.
    """

    intermediate_dim: int = 2048
    activation: str | Sequence[str] = "gelu"
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
    intermediate_dropout_rate: float = 0.0
    intermediate_hidden_dropout_dims: Sequence[int] = ()
    dropout_rng_name: str = "dropout"
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: Any = None
    kernel_axes_1: tuple[str | None, ...] = ()
    kernel_axes_2: tuple[str | None, ...] = ()
    bias_axes_1: tuple[str | None, ...] = ()
    bias_axes_2: tuple[str | None, ...] = ()
    scale_axes: tuple[str | None, ...] = ()
    ln_bias_axes: tuple[str | None, ...] = ()
    dot_general_cls: Any = None
    recompute_norm_act: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        """``[..., H] -> [..., H]``; dropout is active when ``deterministic`` is False."""
        C.check_dtypes(self, x := C.canonical_input(x))
        act = activation_name(self.activation, C.where(self))
        h, f = x.shape[-1], int(self.intermediate_dim)
        if f < 1:
            raise ValueError(f"te_jax: {C.where(self)}: intermediate_dim must be >= 1, got {self.intermediate_dim}")
        gamma, beta, zcg, kind = gemm_norm_params(self, x)
        wi_features = (2, f) if act in GATED else (f,)
        k1 = C.param(self, "wi_kernel", C.flat_init(self.kernel_init, 1), (h, *wi_features), self.param_dtype,
                     self.kernel_axes_1)
        b1 = C.param(self, "wi_bias", C.flat_bias_init(self.bias_init), wi_features, self.param_dtype,
                     self.bias_axes_1) if self.use_bias else None
        k2 = C.param(self, "wo_kernel", C.flat_init(self.kernel_init, 1), (f, h), self.param_dtype,
                     self.kernel_axes_2)
        b2 = C.param(self, "wo_bias", C.flat_bias_init(self.bias_init), (h,), self.param_dtype,
                     self.bias_axes_2) if self.use_bias else None
        dtype = C.compute_dtype(self.dtype, x, gamma if self.use_scale else None, beta, k1, b1, k2, b2)
        C.check_dtypes(self, jnp.zeros((), dtype))
        k1, k2 = k1.astype(dtype), k2.astype(dtype)
        b1, b2 = (None if b is None else b.astype(dtype) for b in (b1, b2))
        if not self.enable_layernorm:
            x = x.astype(dtype)
        mask = C.dropout_mask(self, self.intermediate_dropout_rate, (*x.shape[:-1], f),
                              self.intermediate_hidden_dropout_dims, self.dropout_rng_name, dtype, deterministic)
        quantizers = MLPQuantizers.from_recipe(C.recipe_or_none(), module_path(self))
        return call_op(self, quantizers, functools.partial(
            layernorm_mlp, x, gamma, beta, k1, b1, k2, b2, activation=act, norm_type=kind, zero_centered_gamma=zcg,
            epsilon=self.epsilon, dropout_mask=mask, quantizers=quantizers, precision=self.precision,
            dot_generals=None if self.dot_general_cls is None else tuple(
                C.dot_general_of(self, self.dot_general_cls, quantizers.any) for _ in range(2)),
            recompute_norm_act=self.recompute_norm_act), gemms=GEMMS)
