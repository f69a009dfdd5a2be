"""The functional ops' unquantized path in dtypes te_jax's kernels do not take, and the dtype rule of the ops.

te_jax's kernels (norms, activations, casts, GEMMs) take float32, bfloat16
and float16 (``KERNEL_DTYPES``). Without quantizers the functional ops, and
so the layers outside ``te_jax.autocast``, compute what flax computes; with
``jax_enable_x64`` that includes float64, which runs here in plain JAX:
flax's LayerNorm / RMSNorm (its order of operations, ``flax_normalize``) and
jax.nn's activations. Quantizing needs a kernel dtype, and ``check_dtypes``
says so, with the fix.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.core.gemm_quant import NormSpec, normalize_hp
from te_jax.ops import norm_act as act_ops

__all__ = ["KERNEL_DTYPES", "UNQUANTIZED_DTYPES", "activation", "check_dtypes", "dtype_problem", "flax_normalize",
           "normalize", "quantized_dtype_error"]

KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
UNQUANTIZED_DTYPES = (*KERNEL_DTYPES, jnp.dtype(jnp.float64))  # what the unquantized path computes in


def dtype_problem(dtype, quantized: bool) -> str | None:
    """None for a kernel dtype, and for float64 when not ``quantized``; else "quantized" (float64 under a
    recipe) or "invalid" (any other dtype)."""
    dtype = jnp.dtype(dtype)
    if dtype in KERNEL_DTYPES or (dtype in UNQUANTIZED_DTYPES and not quantized):
        return None
    return "quantized" if dtype in UNQUANTIZED_DTYPES else "invalid"


def quantized_dtype_error(where: str, what: str, dtype, fix: str) -> TypeError:
    """The error for ``what`` (e.g. "the input") in ``dtype`` (float64) under a recipe; ``fix`` gives a kernel
    dtype (e.g. "pass param_dtype=jnp.float32")."""
    return TypeError(f"te_jax: {where}: {what} is {jnp.dtype(dtype)}, which te_jax.autocast cannot quantize (its "
                     f"kernels take float32, bfloat16 or float16): {fix}, or call it outside te_jax.autocast, where "
                     f"{jnp.dtype(dtype)} computes as in flax")


def check_dtypes(where: str, quantized: bool, **arrays) -> None:
    """Every array given (None skipped) is float32, bfloat16 or float16, or, when not ``quantized``, float64."""
    for name, a in arrays.items():
        problem = None if a is None else dtype_problem(a.dtype, quantized)
        if problem == "quantized":
            raise quantized_dtype_error(where, name, a.dtype, f"cast it with {name}.astype(jnp.float32)")
        if problem == "invalid":
            raise TypeError(f"te_jax: {where}: {name} must be float32, bfloat16 or float16 (or float64 outside "
                            f"te_jax.autocast), got {a.dtype}")


def _kernel_dtypes(*arrays) -> bool:
    return all(a is None or jnp.dtype(a.dtype) in KERNEL_DTYPES for a in arrays)


def normalize(norm: NormSpec | None, x, gamma, beta, dtype) -> jax.Array:
    """The unquantized norm in ``dtype``: the kernels' (``normalize_hp``) in their dtypes, else flax's LayerNorm /
    RMSNorm with its defaults (fast variance, statistics in at least float32), as flax computes it."""
    if norm is None:
        return x.astype(dtype)
    if _kernel_dtypes(x, gamma, beta) and jnp.dtype(dtype) in KERNEL_DTYPES:
        return normalize_hp(norm, x, gamma, beta, dtype)
    return flax_normalize(x, gamma, beta, layernorm_type=norm.kind, zero_centered_gamma=norm.zero_centered_gamma,
                          epsilon=norm.epsilon, use_fast_variance=True, force_float32_reductions=True,
                          reduction_dtype=None, param_dtype=dtype, dtype=dtype)


def _activated(x, activation: str):
    """jax.nn's form of te_jax's activation (gelu: the tanh approximation, as the kernels), in x's dtype."""
    if activation in ("gelu", "geglu"):
        return jax.nn.gelu(x, approximate=True)
    if activation in ("silu", "swiglu"):
        return jax.nn.silu(x)
    r = jax.nn.relu(x)
    return r if activation == "relu" else r * r


def activation(h, activation: str) -> jax.Array:
    """The unquantized activation (gated: ``act(h[..., :F]) * h[..., F:]``): the kernels' in their dtypes, else
    jax.nn's in h's dtype."""
    if _kernel_dtypes(h):
        return act_ops.apply_activation(h, activation)
    if activation in act_ops.GATED:
        a, g = jnp.split(h, 2, axis=-1)
        return _activated(a, activation) * g
    return _activated(h, activation)


def flax_normalize(x, gamma, beta, *, layernorm_type: str, zero_centered_gamma: bool, epsilon: float,
                   use_fast_variance: bool, force_float32_reductions: bool, reduction_dtype, param_dtype, dtype,
                   mask=None) -> jax.Array:
    """flax's LayerNorm (RMSNorm) statistics and normalization over the last axis, in its order of operations.

    Args:
      x: the input (flax.nnx's layers promote it with the parameters first).
      gamma, beta: ``[H]`` scale and bias, or None.
      layernorm_type: "layernorm" or "rmsnorm".
      zero_centered_gamma: scale by ``1 + gamma``.
      epsilon: added to the variance.
      use_fast_variance: ``E[x^2] - E[x]^2`` rather than ``E[(x - E[x])^2]``.
      force_float32_reductions: statistics in at least float32 (flax.linen's
        switch; flax.nnx always does).
      reduction_dtype: the layer's ``dtype`` argument (None: the input's), which the statistics use.
      param_dtype: the parameters' dtype (read without float32 reductions).
      dtype: the output dtype.
      mask: broadcastable to ``x``; the elements the statistics read.
    """
    stats_dtype = jnp.result_type(x) if reduction_dtype is None else reduction_dtype
    if force_float32_reductions:
        stats_dtype = jnp.promote_types(stats_dtype, jnp.float32)
    xs = x.astype(stats_dtype)
    where = None if mask is None else jnp.asarray(mask, bool)
    mean = functools.partial(jnp.mean, axis=-1, keepdims=True, where=where)
    if layernorm_type == "rmsnorm":
        var = mean(lax.square(xs))
        mu = jnp.zeros_like(var)
    elif use_fast_variance:
        squares = lax.square(xs)  # before the means: the order of uses sets how x's gradient terms add up
        mu, mu2 = mean(xs), mean(squares)
        var = jnp.maximum(0.0, mu2 - lax.square(mu))
    else:
        mu = mean(xs)
        var = mean(lax.square(xs - mu))
    y = x - mu
    mul = lax.rsqrt(var + epsilon)
    if gamma is not None:
        if not force_float32_reductions:
            gamma = jnp.asarray(gamma, param_dtype)
        mul = mul * (gamma + 1 if zero_centered_gamma else gamma)
    y = y * mul
    if beta is not None:
        y = y + (beta if force_float32_reductions else jnp.asarray(beta, param_dtype))
    return jnp.asarray(y, dtype)
