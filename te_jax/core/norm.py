"""The norm in front of a GEMM (layernorm / rmsnorm), fused into the GEMM input's cast."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from te_jax.core.gemm_quant import GemmQuant
from te_jax.core.remat import NORM_STATS
from te_jax.ops import norm as norm_ops
from te_jax.quantize import fused

NORM_TYPES = ("layernorm", "rmsnorm")


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """The norm in front of a GEMM: kind "layernorm" | "rmsnorm", zero-centred gamma, epsilon."""

    kind: str
    zero_centered_gamma: bool = False
    epsilon: float = 1e-6


def as_norm(norm_type: str | None, zero_centered_gamma: bool, epsilon: float, gamma, beta,
            where: str) -> NormSpec | None:
    """Validates the norm arguments; None when ``norm_type`` is None."""
    if norm_type is None:
        if gamma is not None or beta is not None:
            raise ValueError(f"te_jax: {where}: norm_type=None takes no gamma/beta")
        return None
    if norm_type not in NORM_TYPES:
        raise ValueError(f"te_jax: {where}: norm_type must be one of {NORM_TYPES} or None, got {norm_type!r}")
    if gamma is None:
        raise ValueError(f"te_jax: {where}: a {norm_type} needs gamma (pass ones for no scale)")
    if beta is not None and norm_type == "rmsnorm":
        raise ValueError(f"te_jax: {where}: rmsnorm has no beta; pass beta=None")
    return NormSpec(norm_type, bool(zero_centered_gamma), float(epsilon))


def norm_input(norm: NormSpec | None, g: GemmQuant, x, gamma, beta, dtype, training: bool):
    """The GEMM input ``[M, H]``: ``norm(x)`` written by the "input" quantizer inside the norm kernel.

    Returns ``(ln, (mean, rsigma))``; ln is a ScaledTensor (rowwise, and
    columnwise when ``training``) or, without an input quantizer, an array in ``dtype``.
    """
    if norm is None:
        ln = g.quantize("input", x, rowwise=True, colwise=training) if g.has("input") else x.astype(dtype)
        return ln, (None, None)

    def fn(qz, st, key):
        return fused.norm(x, gamma, beta, qz, st, kind=norm.kind, zero_centered_gamma=norm.zero_centered_gamma,
                          epsilon=norm.epsilon, rowwise=True, colwise=training, key=key, out_dtype=dtype)

    def reference(rows: slice) -> jax.Array:  # a norm is row by row: the rows asked for need only those rows of x
        return fused.norm(x[rows], gamma, beta, kind=norm.kind, zero_centered_gamma=norm.zero_centered_gamma,
                          epsilon=norm.epsilon, out_dtype=jnp.float32, backend="reference")[0]

    ln, mean, rsigma = g.run("input", fn, reference) if g.has("input") else fn(None, None, None)
    return ln, checkpoint_name((mean, rsigma), NORM_STATS)


def norm_backward(norm: NormSpec | None, dln, x, gamma, beta, stats, x_dtype):
    """``(dx, dgamma, dbeta)`` from the gradient of the norm's output (x is None without a norm)."""
    if norm is None:
        return dln.astype(x_dtype), None, None
    mean, rsigma = stats
    dx, dgamma, dbeta = norm_ops.norm_bwd(dln, x, mean, rsigma, gamma, kind=norm.kind,
                                          zero_centered_gamma=norm.zero_centered_gamma)
    return dx, dgamma.astype(gamma.dtype), (None if beta is None else dbeta.astype(beta.dtype))


def normalize_hp(norm: NormSpec | None, x, gamma, beta, dtype):
    """High-precision (unquantized, autodiff) norm in ``dtype``; x is widened first when dtype is wider."""
    if norm is None:
        return x.astype(dtype)
    wide = jnp.promote_types(x.dtype, dtype)
    y = norm_ops.normalize(x.astype(wide), gamma, beta, kind=norm.kind,
                           zero_centered_gamma=norm.zero_centered_gamma, epsilon=norm.epsilon)
    return y.astype(dtype)
