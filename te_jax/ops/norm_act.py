"""LayerNorm / RMSNorm and activations fused with the output's quantization: FFI custom calls + reference twins.

The two families share their structure: argument checks, a body per
direction that runs the kernel on one device's matrices
(``te_jax.ops.primitive``), the forward and backward ops, and a
differentiable unquantized form. The output goes through a cast (``CastSpec``, ``te_jax.ops.cast``):
unquantized, or quantized rowwise ``[M, N]`` and/or columnwise ``[N, M]``
(``M = prod(x.shape[:-1])``) with the layouts of ``te_jax.ops.quantize``. The
reference twin is ``te_jax.spec.reference_norm_act`` (``backend="reference"``).
The FFI contract (docs/norm_act.md; the cast mode is an attribute, vmap adds
leading batch axes to every operand):

``te_jax_norm_fwd``: ``x [..., M, H]``, ``gamma f32 [..., H]``, ``beta f32
    [..., H]`` or ``[..., 0]``, ``scale f32 [..., 1]`` (fp8_tensor),
    ``key u32 [..., 2]`` (NVFP4 stochastic rounding; dummies otherwise);
    attributes ``kind``, ``zero_centered_gamma``, ``epsilon`` and the cast's;
    results: the seven cast results ``q, s, q_t, s_t, amax, amax_t, scale``,
    ``mean f32 [..., M]`` (rmsnorm: ``[..., 0]``), ``rsigma f32 [..., M]``.
``te_jax_norm_bwd``: ``dy, x [..., M, H]``, ``mean``, ``rsigma``, ``gamma``;
    attributes ``kind``, ``zero_centered_gamma``; results ``dx`` (x's dtype),
    ``dgamma f32 [..., H]``, ``dbeta f32 [..., H]`` (rmsnorm: ``[..., 0]``),
    ``workspace f32 [..., 2 * G * H]`` on a GPU (``G = norm_bwd_groups(M)``:
    per-row-group partial sums), empty on CPU.
``te_jax_act_fwd``: ``x [..., M, N]``, ``scale``, ``key``; attributes ``act``
    and the cast's; results: the seven cast results.
``te_jax_act_bwd``: ``dy [..., M, N_out]``, ``x``, ``scale``, ``key``;
    attributes ``act``, ``dbias`` and the cast's; results: the seven cast
    results of ``dx``, ``dbias f32 [..., N]`` (``[..., 0]`` unless asked),
    ``workspace f32 [..., ceil(M/64) * N]`` (GPU dbias partials), else empty.

Activations (float32 math): ``gelu`` (tanh approximation), ``relu``, ``silu``,
``squared_relu``, and the gated ``swiglu = silu(a) * g``, ``geglu = gelu(a) *
g`` with ``x [..., 2F]``, ``a = x[..., :F]``, ``g = x[..., F:]``. A
``[..., 2, F]`` tensor passed with ``pair_axis=True`` keeps F shardable
(tensor parallelism): each device's ``[m, 2, f]`` becomes ``[m, 2f]`` for the
kernel; the gradient comes back as ``[..., 2, F]`` (columnwise ``[2, F, M]``).

CUDA fusion (passes over HBM): a norm's rowwise none / fp8_tensor / mxfp8 /
fp8_block cast takes one pass (a row per thread block); columnwise copies,
fp8_current and nvfp4 add a statistics pass and recompute y from x per tile
(y is never written in high precision). An activation's none / fp8_tensor /
mxfp8 / fp8_block cast takes one pass (dbias partials from the same tile);
fp8_current and nvfp4 take an amax pass over x first.

Sharding: a norm keeps rows split and gathers an H split; an activation keeps
rows and columns split (a gated ``[..., 2F]`` gathers its columns, ``[..., 2,
F]`` keeps them). The fp8_tensor amax takes one pmax; fp8_current and nvfp4
casts of a split output write it in float32 and quantize it with the whole
tensor's amax (``cast.split_cast``, one extra pass); dgamma, dbeta and dbias
are float32 partial sums and one psum. Under a mesh with Explicit axes the
differentiable forms (``normalize``, ``apply_activation``) are typed as jax
types their jnp equivalents (the input's split; a norm's gamma and beta
split H where x does not), their gradients as their primals.
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
from te_jax.ops import primitive as partition
from te_jax.ops import quantize as qops
from te_jax.ops.cast import (
    SPLIT_CASTS, CastOutputs, CastSpec, cast_operands, cast_reduce, cast_tokens, check_spec, result_shapes, split_cast,
)
from te_jax.ops.sharding_types import like, reshape, retype, type_entries
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


def _norm_fwd_body(op, shards, x, gamma, beta, scale, words):
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
    x2 = reshape(x, (m, h))
    g32 = gamma.astype(jnp.float32)
    b32 = beta.astype(jnp.float32) if beta is not None else None
    norm_attrs = dict(kind=kind, zero_centered_gamma=bool(zero_centered_gamma), epsilon=np.float32(epsilon))
    if partition.resolve(backend) == "reference":
        outs = rna.norm_fwd(x2, g32, b32, scale_op, words, spec=spec, **norm_attrs)
    else:
        b_op = b32 if b32 is not None else jnp.zeros((0,), jnp.float32)
        layernorm = kind == "layernorm"
        op = partition.MatrixOp(
            "te_jax_norm_fwd", _norm_fwd_body, (tuple(norm_attrs.items()), spec),
            ("m n", "n", "n" if b32 is not None else "~", "~", "~"),
            (*cast_tokens(spec), "m" if layernorm else "~", "m"), (m, h), reduce=cast_reduce(spec) + (None, None),
            shard_n=False)
        outs = partition.call(op, x2, g32, b_op, scale_op, words)
    lead = x.shape[:-1]
    mean = reshape(outs[7], lead) if kind == "layernorm" else None
    return NormOutputs(CastOutputs(*outs[:7]), mean, reshape(outs[8], lead))


def _norm_bwd_body(op, shards, dy, x, mean, rsigma, gamma):
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
    x2, dy2 = reshape(x, (m, h)).astype(ct), reshape(dy, (m, h)).astype(ct)
    r2 = reshape(rsigma.astype(f32), (m,))
    mean2 = reshape(mean.astype(f32), (m,)) if kind == "layernorm" else jnp.zeros((0,), f32)
    g32 = gamma.astype(f32)
    attrs = dict(kind=kind, zero_centered_gamma=bool(zero_centered_gamma))
    if partition.resolve(backend) == "reference":
        dx, dgamma, dbeta = rna.norm_bwd(dy2, x2, mean2, r2, g32, **attrs)
    else:
        layernorm = kind == "layernorm"
        op = partition.MatrixOp(
            "te_jax_norm_bwd", _norm_bwd_body, tuple(attrs.items()),
            ("m n", "m n", "m" if layernorm else "~", "m", "n"),
            ("m n", "n", "n" if layernorm else "~"), (m, h), reduce=(None, "sum", "sum"), shard_n=False)
        dx, dgamma, dbeta = partition.call(op, dy2, x2, mean2, r2, g32)
    return reshape(dx.astype(x.dtype), x.shape), dgamma, (dbeta if kind == "layernorm" else None)


# ---- the differentiable unquantized form ------------------------------------------------
#
# The norm written through a quantizer is te_jax.quantize.fused.norm.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _normalize(x, gamma, beta, kind, zero_centered_gamma, epsilon, backend):
    return _normalize_fwd(x, gamma, beta, kind, zero_centered_gamma, epsilon, backend)[0]


def _normalize_fwd(x, gamma, beta, kind, zero_centered_gamma, epsilon, backend):
    out = norm_fwd(x, gamma, beta, kind=kind, zero_centered_gamma=zero_centered_gamma, epsilon=epsilon,
                   backend=backend)
    return like(reshape(out.cast.q, x.shape), x, params=(gamma, beta)), (x, out.mean, out.rsigma, gamma, beta)


def _normalize_bwd(kind, zero_centered_gamma, epsilon, backend, res, dy):
    x, mean, rsigma, gamma, beta = res
    dx, dgamma, dbeta = norm_bwd(dy, x, mean, rsigma, gamma, kind=kind, zero_centered_gamma=zero_centered_gamma,
                                 backend=backend)
    # Typed as their primals (Explicit meshes), as jax's transposes type gradients.
    return (retype(dx, type_entries(x)), retype(dgamma.astype(gamma.dtype), type_entries(gamma)),
            None if beta is None else retype(dbeta.astype(beta.dtype), type_entries(beta)))


_normalize.defvjp(_normalize_fwd, _normalize_bwd)


def normalize(x, gamma, beta=None, *, kind="layernorm", zero_centered_gamma=False, epsilon=1e-6, backend=None):
    """Differentiable unquantized norm (output in x's dtype) on the fused kernels."""
    check_norm_args(x, gamma, beta, kind, epsilon)
    return _normalize(x, gamma, beta, kind, bool(zero_centered_gamma), float(epsilon), backend)


# ==== activations ====================================================================

ACTIVATIONS = rna.ACTIVATIONS
GATED = rna.GATED
DBIAS_ROWS = 64


def check_act_args(x, act: str, pair_axis: bool = False) -> int:
    """Validates ``x`` and ``act``; returns the output's last-axis length."""
    qops.check_high_precision(x)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"te_jax: an activation needs x of rank >= 1 with a non-empty last axis, got {x.shape}")
    if act not in ACTIVATIONS:
        raise ValueError(f"te_jax: activation must be one of {ACTIVATIONS}, got {act!r}")
    if pair_axis:
        if act not in GATED:
            raise ValueError(f"te_jax: pair_axis=True is for the gated activations {GATED}, not {act!r}")
        if x.ndim < 2 or x.shape[-2] != 2:
            raise ValueError(f"te_jax: with pair_axis=True, {act} takes x [..., 2, F] (activated half first), "
                             f"got shape {x.shape}")
        return x.shape[-1]
    n = x.shape[-1]
    if act in GATED:
        if n % 2:
            raise ValueError(f"te_jax: {act} takes x [..., 2F] (activated half first); its last axis {n} is odd")
        return n // 2
    return n


def _as_matrix(x, pair_axis: bool):
    """``x`` as the kernels' matrix: ``[M, N]``, or ``[M, 2, F]`` kept for the partitioner."""
    lead = x.shape[:-2] if pair_axis else x.shape[:-1]
    return reshape(x, (math.prod(lead), *x.shape[len(lead):]))


def _x_tokens(act: str, pair_axis: bool) -> str:
    if pair_axis:
        return "m ~ n"
    return "m ~" if act in GATED else "m n"  # [a | g] halves need every column


def _check_pair_blocks(spec: CastSpec, f: int) -> None:
    block = 1 if spec.mode == "none" else spec.scaling_mode.block_cols
    if f % block:
        raise ValueError(f"te_jax: with pair_axis=True, the {spec.mode} cast of the gradient needs F={f} to be a "
                         f"multiple of {block} (blocks may not straddle the [a | g] halves)")


def _act_fwd_body(op, shards, x, scale, words):
    act, spec, pair_axis = op.config
    if pair_axis:
        x = reshape(x, (*x.shape[:-2], -1))  # typed where the unsplit call is traced (Explicit mesh)
    split = shards.count > 1 and spec.mode in SPLIT_CASTS
    kspec = CastSpec("none", jnp.float32) if split else spec

    def kernel(x, scale, words):
        m, n = x.shape
        results = result_shapes(kspec, m, n // 2 if act in GATED else n)
        return tuple(partition.ffi("te_jax_act_fwd", results, x, scale, words, act=act, **kspec.attrs))

    outs = partition.per_matrix(kernel, x.ndim - 2)(x, scale, words)
    return split_cast(outs[0], spec, words, shards) if split else outs


def act_fwd(x, *, act: str, spec: CastSpec = CastSpec(), scale=None, key=None, pair_axis=False,
            backend=None) -> CastOutputs:
    """``act(x)`` over ``x [..., N]``, cast as ``spec`` says; matrices are ``[M, N_out]`` / ``[N_out, M]``.

    ``pair_axis``: a gated ``x [..., 2, F]`` (F may stay sharded) instead of ``[..., 2F]``.
    """
    n_out = check_act_args(x, act, pair_axis)
    xm = _as_matrix(x, pair_axis)
    m = xm.shape[0]
    spec = check_spec(spec, x.dtype, m, n_out)
    scale_op, words = cast_operands(spec, scale, key)
    if partition.resolve(backend) == "reference":
        return CastOutputs(*rna.act_fwd(reshape(xm, (m, -1)), scale_op, words, act=act, spec=spec))
    op = partition.MatrixOp("te_jax_act_fwd", _act_fwd_body, (act, spec, bool(pair_axis)),
                            (_x_tokens(act, pair_axis), "~", "~"), cast_tokens(spec), (m, n_out),
                            reduce=cast_reduce(spec), shard_n=pair_axis or act not in GATED)
    return CastOutputs(*partition.call(op, xm, scale_op, words))


def _pair_form(outs, n_lead: int) -> tuple:
    """Kernel results of a ``[m, 2f]`` gradient with the pair axis: ``[m, 2, f]``, ``[2, f, m]``, dbias ``[2, f]``."""
    q, s, q_t, s_t, *rest, dbias = outs

    def rows(a):
        return reshape(a, (*a.shape[:-1], 2, -1)) if a.ndim == n_lead + 2 else a

    def cols(a):
        return reshape(a, (*a.shape[:-2], 2, -1, a.shape[-1])) if a.ndim == n_lead + 2 else a

    dbias = reshape(dbias, (*dbias.shape[:-1], 2, -1)) if dbias.shape[-1] else dbias
    return (rows(q), rows(s), cols(q_t), cols(s_t), *rest, dbias)


def _act_bwd_body(op, shards, dy, x, scale, words):
    act, spec, dbias, pair_axis = op.config
    if pair_axis:
        x = reshape(x, (*x.shape[:-2], -1))  # typed where the unsplit call is traced (Explicit mesh)
    n_lead = x.ndim - 2
    split = shards.count > 1 and spec.mode in SPLIT_CASTS
    kspec = CastSpec("none", jnp.float32) if split else spec

    def kernel(dy, x, scale, words):
        m, n = x.shape
        f32 = jnp.float32

        def call(ws: int):
            results = (*result_shapes(kspec, m, n), jax.ShapeDtypeStruct((n if dbias else 0,), f32),
                       jax.ShapeDtypeStruct((ws,), f32))
            return lambda *a: tuple(partition.ffi("te_jax_act_bwd", results, *a, act=act, dbias=dbias,
                                                  **kspec.attrs)[:8])

        ws_gpu = -(-m // DBIAS_ROWS) * n if dbias else 0
        return lax.platform_dependent(dy, x, scale, words, cpu=call(0), cuda=call(ws_gpu))

    outs = partition.per_matrix(kernel, n_lead)(dy, x, scale, words)
    if split:
        outs = (*split_cast(outs[0], spec, words, shards), outs[7])
    return _pair_form(outs, n_lead) if pair_axis else outs


def act_bwd(dy, x, *, act: str, spec: CastSpec = CastSpec(), scale=None, key=None, dbias=False, pair_axis=False,
            backend=None):
    """``dx = dy * act'(x)`` (same shape as x) cast as ``spec`` says, and ``dbias``.

    Returns ``(CastOutputs, dbias)``: dbias is the float32 sum of dx over all
    rows, ``[N]``, or None unless ``dbias=True``. For "none" the output dtype
    defaults to x's. With ``pair_axis`` (x ``[..., 2, F]``) the results keep
    the pair axis: ``q [M, 2, F]`` (NVFP4 ``[M, 2, F/2]``), ``s [M, 2, F/block]``,
    ``q_t [2, F, M]``, ``s_t [2, F, M/block]``, dbias ``[2, F]``: the bytes of
    the ``[M, 2F]`` / ``[2F, M]`` matrices, sharded like F.
    """
    n_out = check_act_args(x, act, pair_axis)
    qops.check_high_precision(dy, "dy")
    want = (*x.shape[:-2], n_out) if pair_axis else (*x.shape[:-1], n_out)
    if dy.shape != want:
        raise ValueError(f"te_jax: dy must have shape {want} (the activation's output), got {dy.shape}")
    ct = jnp.promote_types(x.dtype, dy.dtype)  # the kernels take dy and x in one dtype
    xm = _as_matrix(x, pair_axis).astype(ct)
    m = xm.shape[0]
    n = math.prod(xm.shape[1:])
    spec = check_spec(spec, x.dtype, m, n)
    if pair_axis:
        _check_pair_blocks(spec, n_out)
    scale_op, words = cast_operands(spec, scale, key)
    dy2 = reshape(dy, (m, n_out)).astype(ct)
    if partition.resolve(backend) == "reference":
        outs = rna.act_bwd(dy2, reshape(xm, (m, n)), scale_op, words, act=act, spec=spec, dbias=bool(dbias))
        outs = _pair_form(outs, 0) if pair_axis else outs
    else:
        gated_flat = act in GATED and not pair_axis
        cols = ("~", "n") if pair_axis else (("~",) if gated_flat else ("n",))
        dbias_tokens = " ".join(cols) if dbias else "~"
        op = partition.MatrixOp(
            "te_jax_act_bwd", _act_bwd_body, (act, spec, bool(dbias), bool(pair_axis)),
            ("m n", _x_tokens(act, pair_axis), "~", "~"),
            (*cast_tokens(spec, cols), dbias_tokens), (m, n_out), reduce=cast_reduce(spec) + ("sum",),
            shard_n=not gated_flat)
        outs = partition.call(op, dy2, xm, scale_op, words)
    return CastOutputs(*outs[:7]), (outs[7] if dbias else None)


# ---- layouts and the differentiable unquantized form ------------------------------------
#
# The forms written through a quantizer (activation, activation_grad) live in te_jax.quantize.fused.


def out_shape(x, act: str, pair_axis: bool = False) -> tuple[int, ...]:
    """The activation's output shape for an input ``x``."""
    if pair_axis:
        return (*x.shape[:-2], x.shape[-1])
    return (*x.shape[:-1], x.shape[-1] // 2 if act in GATED else x.shape[-1])


def matrix_form(outs: CastOutputs) -> CastOutputs:
    """Pair-form cast results (``[M, 2, F]``, ``[2, F, M]``) as the ``[M, 2F]`` / ``[2F, M]`` matrices."""
    def rows(a):
        return reshape(a, (a.shape[0], -1)) if a.ndim == 3 else a

    def cols(a):
        return reshape(a, (-1, a.shape[-1])) if a.ndim == 3 else a

    return outs._replace(q=rows(outs.q), s=rows(outs.s), q_t=cols(outs.q_t), s_t=cols(outs.s_t))


def _unquantized(x, act, pair_axis, backend):
    outs = act_fwd(x, act=act, spec=CastSpec("none", x.dtype), pair_axis=pair_axis, backend=backend)
    return like(reshape(outs.q, out_shape(x, act, pair_axis)), x, drop=(x.ndim - 2,) if pair_axis else ())


def _unquantized_grad(dy, x, act, pair_axis, backend):
    outs, _ = act_bwd(dy, x, act=act, spec=CastSpec("none", x.dtype), pair_axis=pair_axis, backend=backend)
    return retype(reshape(outs.q, x.shape), type_entries(x))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _apply(x, act, pair_axis, backend):
    return _unquantized(x, act, pair_axis, backend)


def _apply_fwd(x, act, pair_axis, backend):
    return _unquantized(x, act, pair_axis, backend), x


def _apply_bwd(act, pair_axis, backend, x, dy):
    return (_unquantized_grad(dy, x, act, pair_axis, backend),)


_apply.defvjp(_apply_fwd, _apply_bwd)


def apply_activation(x, act: str, *, pair_axis=False, backend=None):
    """Differentiable unquantized activation (output in x's dtype) on the fused kernels."""
    check_act_args(x, act, pair_axis)
    return _apply(x, act, bool(pair_axis), backend)


__all__ = ["ACTIVATIONS", "DBIAS_ROWS", "GATED", "NORM_KINDS", "NormOutputs", "act_bwd", "act_fwd",
           "apply_activation", "check_act_args", "check_norm_args", "matrix_form", "norm_bwd", "norm_bwd_groups",
           "norm_fwd", "normalize", "out_shape"]
