"""LayerNorm / RMSNorm fused with the output's quantization: FFI custom calls + reference twin.

``x [..., H]`` is normalized over H (float32 statistics) and written through a
cast (``CastSpec``, see ``te_jax.ops.cast``): unquantized, or quantized
rowwise ``[M, H]`` and/or columnwise ``[H, M]`` (``M = prod(x.shape[:-1])``)
with the layouts of ``te_jax.ops.quantize``. The reference twin is
``te_jax.spec.reference_norm_act`` (``backend="reference"``).

FFI targets (one per direction; the cast mode is an attribute; vmap adds
leading batch axes to every operand, ``vmap_method="broadcast_all"``):

``te_jax_norm_fwd``
    operands: ``x [..., M, H]`` (f32/bf16/f16), ``gamma f32 [..., H]``,
    ``beta f32 [..., H]`` or ``[..., 0]`` (no bias), ``scale f32 [..., 1]``
    (fp8_tensor mode; a dummy otherwise), ``key u32 [..., 2]`` (NVFP4
    stochastic rounding; a dummy otherwise).
    attributes: ``kind`` ("layernorm" | "rmsnorm"), ``zero_centered_gamma``,
    ``epsilon``, and the cast's ``mode, rowwise, colwise, power_2,
    amax_epsilon, rht, stochastic_rounding``.
    results: the seven cast results ``q, s, q_t, s_t, amax, amax_t, scale``,
    then ``mean f32 [..., M]`` (rmsnorm: ``[..., 0]``), ``rsigma f32 [..., M]``.

``te_jax_norm_bwd``
    operands: ``dy [..., M, H]``, ``x [..., M, H]``, ``mean f32 [..., M]`` (or
    ``[..., 0]``), ``rsigma f32 [..., M]``, ``gamma f32 [..., H]``.
    attributes: ``kind``, ``zero_centered_gamma``.
    results: ``dx [..., M, H]`` (x's dtype), ``dgamma f32 [..., H]``, ``dbeta
    f32 [..., H]`` (rmsnorm: ``[..., 0]``), ``workspace f32 [..., W]``: the
    per-row-group partial sums of dgamma/dbeta on a GPU (``W = 2 * G * H``,
    ``G = norm_bwd_groups(M)``), empty on CPU.

How the CUDA kernels fuse (passes over HBM; docs/norm_act.md):

* rowwise only, modes none / fp8_tensor / mxfp8 / fp8_block: one pass (a
  thread block per row keeps the row in registers: statistics, then the cast).
* columnwise copies, fp8_current, nvfp4: a statistics pass reads x and writes
  mean/rsigma (and the output's amax), then a tile pass recomputes y from x
  and writes every requested copy (NVFP4 with the Hadamard transform adds a
  tile pass for the transformed amax). y is never written in high precision.

Sharding (``te_jax.ops.primitive``): rows stay split, an H split is gathered
(a norm needs whole rows). The fp8_tensor amax takes one pmax; fp8_current and
nvfp4 casts of split rows write y in float32 and quantize it with the whole
tensor's amax (``fused_cast.split_cast``, one extra pass); the backward's
dgamma and dbeta are float32 partial sums and one psum.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import te_jax.ops.ffi  # noqa: F401  (registers the FFI targets)
from te_jax.ops import backend as backend_lib
from te_jax.ops import primitive as partition
from te_jax.ops import quantize as qops
from te_jax.ops.cast import (
    SPLIT_CASTS, CastOutputs, CastSpec, cast_operands, cast_reduce, cast_tokens, check_spec, result_shapes, split_cast,
)
from te_jax.spec import reference_norm_act as rna

NORM_KINDS = rna.NORM_KINDS
BWD_ROWS_PER_GROUP = 64
BWD_MAX_GROUPS = 256


class NormOutputs(NamedTuple):
    cast: CastOutputs
    mean: jax.Array | None  # [...] (x.shape[:-1]); None for rmsnorm
    rsigma: jax.Array       # [...]


def norm_bwd_groups(m: int) -> int:
    """Row groups whose dgamma/dbeta partial sums the CUDA backward writes to its workspace."""
    return max(1, min(BWD_MAX_GROUPS, -(-m // BWD_ROWS_PER_GROUP)))


# ---- validation ------------------------------------------------------------------------


def _check_param(p, name: str, h: int) -> None:
    qops.check_high_precision(p, name)
    if p.shape != (h,):
        raise ValueError(f"te_jax: {name} must have shape ({h},) (the normalized axis of x), got {p.shape}")


def check_norm_args(x, gamma, beta, kind: str, epsilon: float) -> None:
    qops.check_high_precision(x)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"te_jax: a norm needs x of rank >= 1 with a non-empty last axis, got shape {x.shape}")
    if kind not in NORM_KINDS:
        raise ValueError(f"te_jax: norm kind must be one of {NORM_KINDS}, got {kind!r}")
    _check_param(gamma, "gamma", x.shape[-1])
    if beta is not None:
        if kind == "rmsnorm":
            raise ValueError("te_jax: rmsnorm has no beta; pass beta=None")
        _check_param(beta, "beta", x.shape[-1])
    if not (np.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"te_jax: epsilon must be a finite number >= 0, got {epsilon}")



def _fwd_body(op, shards, x, gamma, beta, scale, words):
    norm_attrs, spec = op.config
    split = shards.count > 1 and spec.mode in SPLIT_CASTS
    kspec = CastSpec("none", jnp.float32) if split else spec

    def kernel(x, gamma, beta, scale, words):
        m, h = x.shape
        f32 = jnp.float32
        mean = jax.ShapeDtypeStruct((m if op.results[7] == "m" else 0,), f32)
        results = (*result_shapes(kspec, m, h), mean, jax.ShapeDtypeStruct((m,), f32))
        return tuple(partition.ffi("te_jax_norm_fwd", results, x, gamma, beta, scale, words, **dict(norm_attrs),
                                   **kspec.attrs))

    outs = partition.per_matrix(kernel, x.ndim - 2)(x, gamma, beta, scale, words)
    if not split:
        return outs
    return (*split_cast(outs[0], spec, words, shards), *outs[7:])


# ---- forward ------------------------------------------------------------------------------


def norm_fwd(x, gamma, beta=None, *, kind="layernorm", zero_centered_gamma=False, epsilon=1e-6,
             spec: CastSpec = CastSpec(), scale=None, key=None, backend=None) -> NormOutputs:
    """Normalizes ``x [..., H]`` over its last axis and casts the result as ``spec`` says.

    ``scale`` (float32 ``[1]``) is the fp8_tensor mode's scale; ``key`` a PRNG
    key for NVFP4 stochastic rounding. Returns ``NormOutputs(cast, mean,
    rsigma)``; the cast's matrices are ``[M, H]`` / ``[H, M]``.
    """
    check_norm_args(x, gamma, beta, kind, epsilon)
    h = x.shape[-1]
    m = math.prod(x.shape[:-1])
    spec = check_spec(spec, x.dtype, m, h)
    scale_op, words = cast_operands(spec, scale, key)
    x2 = x.reshape(m, h)
    g32 = gamma.astype(jnp.float32)
    b32 = beta.astype(jnp.float32) if beta is not None else None
    norm_attrs = dict(kind=kind, zero_centered_gamma=bool(zero_centered_gamma), epsilon=np.float32(epsilon))
    if backend_lib.resolve(backend) == "reference":
        outs = rna.norm_fwd(x2, g32, b32, scale_op, words, spec=spec, **norm_attrs)
    else:
        b_op = b32 if b32 is not None else jnp.zeros((0,), jnp.float32)
        layernorm = kind == "layernorm"
        op = partition.MatrixOp(
            "te_jax_norm_fwd", _fwd_body, (tuple(norm_attrs.items()), spec),
            ("m n", "n", "n" if b32 is not None else "~", "~", "~"),
            (*cast_tokens(spec), "m" if layernorm else "~", "m"), (m, h), reduce=cast_reduce(spec) + (None, None),
            shard_n=False)
        outs = partition.call(op, x2, g32, b_op, scale_op, words)
    lead = x.shape[:-1]
    mean = outs[7].reshape(lead) if kind == "layernorm" else None
    return NormOutputs(CastOutputs(*outs[:7]), mean, outs[8].reshape(lead))


def _bwd_body(op, shards, dy, x, mean, rsigma, gamma):
    attrs = dict(op.config)

    def kernel(dy, x, mean, rsigma, gamma):
        m, h = x.shape
        f32 = jnp.float32
        nb = h if attrs["kind"] == "layernorm" else 0

        def call(ws: int):
            results = (jax.ShapeDtypeStruct((m, h), x.dtype), jax.ShapeDtypeStruct((h,), f32),
                       jax.ShapeDtypeStruct((nb,), f32), jax.ShapeDtypeStruct((ws,), f32))
            return lambda *a: tuple(partition.ffi("te_jax_norm_bwd", results, *a, **attrs)[:3])

        ws_gpu = 2 * norm_bwd_groups(m) * h
        return lax.platform_dependent(dy, x, mean, rsigma, gamma, cpu=call(0), cuda=call(ws_gpu))

    return partition.per_matrix(kernel, x.ndim - 2)(dy, x, mean, rsigma, gamma)


# ---- backward -----------------------------------------------------------------------------


def norm_bwd(dy, x, mean, rsigma, gamma, *, kind="layernorm", zero_centered_gamma=False, backend=None):
    """``(dx, dgamma, dbeta)``: dx in x's dtype, dgamma/dbeta float32 (dbeta None for rmsnorm).

    ``mean``/``rsigma`` are the forward's (shape ``x.shape[:-1]``; mean None for rmsnorm).
    """
    check_norm_args(x, gamma, None, kind, 0.0)
    qops.check_high_precision(dy, "dy")
    if dy.shape != x.shape:
        raise ValueError(f"te_jax: dy must have x's shape {x.shape}, got {dy.shape}")
    lead = x.shape[:-1]
    if kind == "layernorm" and (mean is None or mean.shape != lead):
        raise ValueError(f"te_jax: layernorm backward needs the forward's mean of shape {lead}")
    if rsigma.shape != lead:
        raise ValueError(f"te_jax: rsigma must have shape {lead}, got {rsigma.shape}")
    h = x.shape[-1]
    m = math.prod(lead)
    f32 = jnp.float32
    ct = jnp.promote_types(x.dtype, dy.dtype)  # the kernels take dy and x in one dtype
    x2, dy2 = x.reshape(m, h).astype(ct), dy.reshape(m, h).astype(ct)
    r2 = rsigma.astype(f32).reshape(m)
    mean2 = mean.astype(f32).reshape(m) if kind == "layernorm" else jnp.zeros((0,), f32)
    g32 = gamma.astype(f32)
    attrs = dict(kind=kind, zero_centered_gamma=bool(zero_centered_gamma))
    if backend_lib.resolve(backend) == "reference":
        dx, dgamma, dbeta = rna.norm_bwd(dy2, x2, mean2, r2, g32, **attrs)
    else:
        layernorm = kind == "layernorm"
        op = partition.MatrixOp(
            "te_jax_norm_bwd", _bwd_body, tuple(attrs.items()),
            ("m n", "m n", "m" if layernorm else "~", "m", "n"),
            ("m n", "n", "n" if layernorm else "~"), (m, h), reduce=(None, "sum", "sum"), shard_n=False)
        dx, dgamma, dbeta = partition.call(op, dy2, x2, mean2, r2, g32)
    return dx.astype(x.dtype).reshape(x.shape), dgamma, (dbeta if kind == "layernorm" else None)


# ---- the differentiable unquantized form ------------------------------------------------
#
# The norm written through a quantizer is te_jax.quantize.fused.norm.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _normalize(x, gamma, beta, kind, zero_centered_gamma, epsilon, backend):
    return _normalize_fwd(x, gamma, beta, kind, zero_centered_gamma, epsilon, backend)[0]


def _normalize_fwd(x, gamma, beta, kind, zero_centered_gamma, epsilon, backend):
    out = norm_fwd(x, gamma, beta, kind=kind, zero_centered_gamma=zero_centered_gamma, epsilon=epsilon,
                   backend=backend)
    return out.cast.q.reshape(x.shape), (x, out.mean, out.rsigma, gamma, beta)


def _normalize_bwd(kind, zero_centered_gamma, epsilon, backend, res, dy):
    x, mean, rsigma, gamma, beta = res
    dx, dgamma, dbeta = norm_bwd(dy, x, mean, rsigma, gamma, kind=kind, zero_centered_gamma=zero_centered_gamma,
                                 backend=backend)
    return dx, dgamma.astype(gamma.dtype), (None if beta is None else dbeta.astype(beta.dtype))


_normalize.defvjp(_normalize_fwd, _normalize_bwd)


def normalize(x, gamma, beta=None, *, kind="layernorm", zero_centered_gamma=False, epsilon=1e-6, backend=None):
    """Differentiable unquantized norm (output in x's dtype) on the fused kernels."""
    check_norm_args(x, gamma, beta, kind, epsilon)
    return _normalize(x, gamma, beta, kind, bool(zero_centered_gamma), float(epsilon), backend)


__all__ = ["NORM_KINDS", "NormOutputs", "check_norm_args", "norm_bwd", "norm_bwd_groups", "norm_fwd",
           "normalize"]
