"""Pure-JAX reference twins of the fused norm and activation kernels (the spec).

Every function takes matrices ``[..., M, N]`` (leading axes: a batch) and
returns what the matching ``te_jax_norm_*`` / ``te_jax_act_*`` custom call
writes. All math is float32. The kernels compute the same float32 formulas
(``csrc/common/norm_act.h``) and then cast with *exactly* the quantize spec
(``cast_outputs`` below, built from ``te_jax.spec.reference``); the
cast's attributes are ``te_jax.ops.cast.CastSpec``.

What is bit-exact and what is not (docs/norm_act.md):

* Given the float32 output ``y`` a kernel computed, its quantized outputs equal
  ``cast_outputs(y, ...)`` bit for bit (same amax, scales and codes).
* ``y`` itself, the statistics and the gradients agree with this reference to
  a few float32 ulps: reduction order is unspecified, XLA contracts
  multiply-adds into FMAs and rewrites ``1/sqrt`` and ``/ H``, and ``tanh`` and
  ``exp`` differ by an ulp or two between XLA, libm and CUDA.

Statistics (two-pass, float32): layernorm ``mean = sum(x) / H``,
``var = sum((x - mean)^2) / H``; rmsnorm ``var = sum(x^2) / H``;
``rsigma = 1 / sqrt(var + eps)``. Output
``y = ((x - mean) * rsigma) * w + b`` (rmsnorm: ``(x * rsigma) * w``) with
``w = gamma`` or ``1 + gamma`` (zero-centred gamma), in that order of float32
operations.

Activations: ``gelu`` is the tanh approximation (``jax.nn.gelu``'s default),
``squared_relu`` is ``relu(x)^2``. Gated kinds take ``[..., 2F]``: the first
half ``a = x[..., :F]`` goes through the activation, the second ``g =
x[..., F:]`` is the linear gate: ``swiglu = silu(a) * g``, ``geglu = gelu(a)
* g``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from te_jax.spec import modes
from te_jax.spec import numerics as nm
from te_jax.spec import reference as ref

if TYPE_CHECKING:  # the cast's attribute contract belongs to the ops layer
    from te_jax.spec.modes import CastSpec

F32 = jnp.float32
NORM_KINDS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "relu", "silu", "squared_relu", "swiglu", "geglu")
GATED = ("swiglu", "geglu")
GELU_C = np.float32(0.7978845608028654)  # sqrt(2 / pi)
GELU_K = np.float32(0.044715)


def _empty(x, dtype):
    return jnp.zeros((*x.shape[:-2], 0), dtype)


def cast_outputs(y, spec: CastSpec, scale=None, key_words=None):
    """The seven cast results of float32 ``y [..., M, N]``: ``(q, s, q_t, s_t, amax, amax_t, scale)``.

    * none: ``q`` is ``y`` in ``spec.qdtype``; the rest are empty.
    * fp8_tensor / fp8_current: ``s`` is ``scale_inv [..., 1]`` (shared by both
      copies), ``amax`` the amax of ``y``; fp8_current also returns ``scale``.
    * mxfp8 / fp8_block: ``s``/``s_t`` the block scales of each copy.
    * nvfp4: ``s``/``s_t`` E4M3 block scales, ``amax``/``amax_t`` the global amaxes.

    Disabled outputs are empty ``[..., 0]`` arrays; the layouts are those of
    ``te_jax.ops.quantize``.
    """
    y = y.astype(F32)
    f32e = _empty(y, F32)
    row, col, mode = spec.rowwise, spec.colwise, spec.mode
    if mode == "none":
        return y.astype(spec.qdtype), f32e, _empty(y, spec.qdtype), f32e, f32e, f32e, f32e
    if mode == "fp8_tensor":
        q, q_t, amax, sinv = ref.quantize_fp8_tensor(y, scale, qdtype=spec.qdtype, rowwise=row, colwise=col)
        return q, sinv, q_t, f32e, amax, f32e, f32e
    if mode == "fp8_current":
        q, q_t, amax, sc, sinv = ref.quantize_fp8_current(
            y, qdtype=spec.qdtype, rowwise=row, colwise=col, power_2=spec.power_2, epsilon=spec.epsilon
        )
        return q, sinv, q_t, f32e, amax, f32e, sc
    if mode == "mxfp8":
        return (*ref.quantize_mxfp8(y, qdtype=spec.qdtype, rowwise=row, colwise=col), f32e, f32e, f32e)
    if mode == "fp8_block":
        out = ref.quantize_fp8_block(y, qdtype=spec.qdtype, rowwise=row, colwise=col, power_2=spec.power_2)
        return (*out, f32e, f32e, f32e)
    if mode == "nvfp4":
        q, s, q_t, s_t, amax, amax_t = ref.quantize_nvfp4(
            y, key_words, rowwise=row, colwise=col, rht=spec.rht and col,
            stochastic_rounding=spec.stochastic_rounding,
        )
        return q, s, q_t, s_t, amax, amax_t, f32e
    raise ValueError(f"te_jax: unknown cast mode {mode!r}")


# ---- normalization -----------------------------------------------------------------------


def norm_stats(xf, *, kind: str, epsilon: float):
    """``(mean, rsigma)`` over the last axis of float32 ``xf``; mean is None for rmsnorm."""
    h = np.float32(xf.shape[-1])
    if kind == "layernorm":
        mean = jnp.sum(xf, axis=-1) / h
        d = xf - mean[..., None]
        var = jnp.sum(d * d, axis=-1) / h
    else:
        mean = None
        var = jnp.sum(xf * xf, axis=-1) / h
    rsigma = F32(1) / jnp.sqrt(var + np.float32(epsilon))
    return mean, rsigma


def norm_weight(gamma, zero_centered_gamma: bool):
    w = gamma.astype(F32)
    return F32(1) + w if zero_centered_gamma else w


def norm_apply(xf, mean, rsigma, gamma, beta, *, kind: str, zero_centered_gamma: bool):
    """The float32 normalized output given the statistics (``beta`` None: no bias)."""
    w = norm_weight(gamma, zero_centered_gamma)[..., None, :]
    if kind == "layernorm":
        xhat = (xf - mean[..., None]) * rsigma[..., None]
        return xhat * w if beta is None else xhat * w + beta.astype(F32)[..., None, :]
    return (xf * rsigma[..., None]) * w


def norm_fwd(x, gamma, beta, scale=None, key_words=None, *, kind, zero_centered_gamma, epsilon, spec: CastSpec):
    """Norm of ``x [..., M, H]`` over H, then the cast.

    Returns the seven cast results, then ``mean [..., M]`` (rmsnorm: empty
    ``[..., 0]``) and ``rsigma [..., M]``.
    """
    xf = x.astype(F32)
    mean, rsigma = norm_stats(xf, kind=kind, epsilon=epsilon)
    y = norm_apply(xf, mean, rsigma, gamma, beta, kind=kind, zero_centered_gamma=zero_centered_gamma)
    mean_out = mean if mean is not None else jnp.zeros((*x.shape[:-2], 0), F32)
    return (*cast_outputs(y, spec, scale, key_words), mean_out, rsigma)


def norm_bwd(dy, x, mean, rsigma, gamma, *, kind, zero_centered_gamma):
    """``(dx, dgamma, dbeta)`` in float32 (dbeta None for rmsnorm).

    ``xhat = (x - mean) * rsigma``, ``g = dy * w``;
    layernorm ``dx = rsigma * (g - mean(g) - xhat * mean(g * xhat))``,
    rmsnorm ``dx = rsigma * (g - xhat * mean(g * xhat))``;
    ``dgamma = sum_rows(dy * xhat)``, ``dbeta = sum_rows(dy)``.
    """
    xf, dyf = x.astype(F32), dy.astype(F32)
    h = np.float32(x.shape[-1])
    r = rsigma[..., None]
    xhat = (xf - mean[..., None]) * r if kind == "layernorm" else xf * r
    g = dyf * norm_weight(gamma, zero_centered_gamma)[..., None, :]
    mgx = (jnp.sum(g * xhat, axis=-1) / h)[..., None]
    if kind == "layernorm":
        mg = (jnp.sum(g, axis=-1) / h)[..., None]
        dx = r * ((g - mg) - xhat * mgx)
        dbeta = jnp.sum(dyf, axis=-2)
    else:
        dx = r * (g - xhat * mgx)
        dbeta = None
    dgamma = jnp.sum(dyf * xhat, axis=-2)
    return dx, dgamma, dbeta


# ---- activations -------------------------------------------------------------------------


def _relu(x):
    return jnp.where((x > 0) | jnp.isnan(x), x, F32(0))


def act_value(x, act: str):
    """The activation (the activated half's function for the gated kinds), float32."""
    if act in ("gelu", "geglu"):
        inner = GELU_C * (x + GELU_K * (x * x * x))
        return x * (F32(0.5) * (F32(1) + jnp.tanh(inner)))
    if act in ("silu", "swiglu"):
        return x * (F32(1) / (F32(1) + jnp.exp(-x)))
    r = _relu(x)
    return r if act == "relu" else r * r


def act_grad(x, act: str):
    """d act / dx (see csrc/common/norm_act.h: ActGrad)."""
    if act in ("gelu", "geglu"):
        x2 = x * x
        t = jnp.tanh(GELU_C * (x + GELU_K * (x2 * x)))
        left = F32(0.5) * (F32(1) + t)
        dinner = GELU_C * (F32(1) + np.float32(3) * GELU_K * x2)
        return left + ((F32(0.5) * x) * (F32(1) - t * t)) * dinner
    if act in ("silu", "swiglu"):
        s = F32(1) / (F32(1) + jnp.exp(-x))
        return s * (F32(1) + x * (F32(1) - s))
    if act == "relu":
        return jnp.where(jnp.isnan(x), x, jnp.where(x > 0, F32(1), F32(0)))
    return F32(2) * _relu(x)


def _split(xf):
    f = xf.shape[-1] // 2
    return xf[..., :f], xf[..., f:]


def act_apply(x, act: str):
    """float32 forward: ``[..., N] -> [..., N]`` or, gated, ``[..., 2F] -> [..., F]``."""
    xf = x.astype(F32)
    if act in GATED:
        a, g = _split(xf)
        return act_value(a, act) * g
    return act_value(xf, act)


def act_apply_grad(dy, x, act: str):
    """float32 ``dx`` (same shape as ``x``) for the output gradient ``dy``."""
    xf, dyf = x.astype(F32), dy.astype(F32)
    if act in GATED:
        a, g = _split(xf)
        return jnp.concatenate([(dyf * g) * act_grad(a, act), dyf * act_value(a, act)], axis=-1)
    return dyf * act_grad(xf, act)


def act_fwd(x, scale=None, key_words=None, *, act: str, spec: CastSpec):
    """Activation of ``x [..., M, N]``, then the cast: the seven cast results."""
    return cast_outputs(act_apply(x, act), spec, scale, key_words)


def act_bwd(dy, x, scale=None, key_words=None, *, act: str, spec: CastSpec, dbias: bool):
    """``dx`` cast, plus ``dbias [..., N]`` (float32 column sums of dx; empty unless asked)."""
    dx = act_apply_grad(dy, x, act)
    db = jnp.sum(dx, axis=-2) if dbias else jnp.zeros((*x.shape[:-2], 0), F32)
    return (*cast_outputs(dx, spec, scale, key_words), db)


def dequantized(outs, spec: CastSpec, colwise: bool = False):
    """float32 values of the rowwise (or columnwise, as ``[..., N, M]``) cast results; for tests."""
    q, s, q_t, s_t, amax, amax_t, _ = outs
    data, scales = (q_t, s_t) if colwise else (q, s)
    if spec.mode == "none":
        return data.astype(F32)
    mode = modes.by_cast_mode(spec.mode)
    v = mode.reference_dequantize(data, s if mode.per_tensor else scales, amax_t if colwise else amax, F32)
    return nm.inverse_rht16(v) if (colwise and spec.rht) else v


__all__ = [
    "ACTIVATIONS", "GATED", "NORM_KINDS", "act_apply", "act_apply_grad", "act_bwd",
    "act_fwd", "act_grad", "act_value", "cast_outputs", "dequantized", "norm_apply", "norm_bwd", "norm_fwd",
    "norm_stats", "norm_weight",
]
