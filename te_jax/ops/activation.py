"""Activations fused with the output's quantization, and their backward fused with dbias.

Activations (float32 math, ``te_jax.spec.reference_norm_act`` is the reference
twin): ``gelu`` (tanh approximation, ``jax.nn.gelu``'s default), ``relu``,
``silu``, ``squared_relu``, and the gated ``swiglu = silu(a) * g`` and
``geglu = gelu(a) * g``, where the input's last axis is ``[2F]``: ``a =
x[..., :F]`` (the activated half) and ``g = x[..., F:]`` (the gate). A
``[..., 2, F]`` tensor (e.g. a DenseGeneral with ``features=(2, F)``) reshaped
to ``[..., 2F]`` has exactly this layout; pass it as is with ``pair_axis=True``
so that F may stay sharded (tensor parallelism): each device's ``[m, 2, f]``
becomes ``[m, 2f]`` for the kernel, and the gradient comes back as
``[..., 2, F]`` (its columnwise copy ``[2, F, M]``).

The output ``[M, N_out]`` (``M = prod(x.shape[:-1])``) goes through a cast
(``CastSpec``, see ``te_jax.ops.cast``) with the layouts of
``te_jax.ops.quantize``.

FFI targets (vmap adds leading batch axes to every operand):

``te_jax_act_fwd``
    operands: ``x [..., M, N]``, ``scale f32 [..., 1]``, ``key u32 [..., 2]``
    (dummies unless fp8_tensor / NVFP4 stochastic rounding).
    attributes: ``act`` and the cast's ``mode, rowwise, colwise, power_2,
    amax_epsilon, rht, stochastic_rounding``.
    results: the seven cast results ``q, s, q_t, s_t, amax, amax_t, scale``.

``te_jax_act_bwd``
    operands: ``dy [..., M, N_out]``, ``x [..., M, N]``, ``scale``, ``key``.
    attributes: ``act``, ``dbias`` (bool), and the cast's.
    results: the seven cast results of ``dx [..., M, N]``, ``dbias f32 [...,
    N]`` (``[..., 0]`` unless asked), ``workspace f32 [..., W]``: per-64-row
    partial column sums for dbias on a GPU (``W = ceil(M/64) * N``), else empty.

Sharding (``te_jax.ops.primitive``): rows and columns stay split (a gated
``[..., 2F]`` input gathers its columns, ``[..., 2, F]`` keeps them); the
fp8_tensor amax takes one pmax, fp8_current and nvfp4 casts of a split output
write it in float32 and quantize it with the whole tensor's amax
(``fused_cast.split_cast``, one extra pass), and dbias is float32 partial
sums and one psum.

CUDA fusion: modes none / fp8_tensor / mxfp8 / fp8_block take one pass (read x,
write the copies; a tile transpose for columnwise copies; dbias partials from
the same tile). fp8_current and nvfp4 take an amax pass over x first (no
output written), then the same pass.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

import te_jax.ops.ffi  # noqa: F401  (registers the FFI targets)
from te_jax.ops import backend as backend_lib
from te_jax.ops import primitive as partition
from te_jax.ops import quantize as qops
from te_jax.ops.cast import (
    SPLIT_CASTS, CastOutputs, CastSpec, cast_operands, cast_reduce, cast_tokens, check_spec, result_shapes, split_cast,
)
from te_jax.spec import reference_norm_act as rna

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
    return x.reshape(math.prod(lead), *x.shape[len(lead):])


def _x_tokens(act: str, pair_axis: bool) -> str:
    if pair_axis:
        return "m ~ n"
    return "m ~" if act in GATED else "m n"  # [a | g] halves need every column


def _check_pair_blocks(spec: CastSpec, f: int) -> None:
    block = 1 if spec.mode == "none" else spec.scaling_mode.block_cols
    if f % block:
        raise ValueError(f"te_jax: with pair_axis=True, the {spec.mode} cast of the gradient needs F={f} to be a "
                         f"multiple of {block} (blocks may not straddle the [a | g] halves)")


def _fwd_body(op, shards, x, scale, words):
    act, spec, pair_axis = op.config
    if pair_axis:
        x = x.reshape(*x.shape[:-2], -1)
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
    if backend_lib.resolve(backend) == "reference":
        return CastOutputs(*rna.act_fwd(xm.reshape(m, -1), scale_op, words, act=act, spec=spec))
    op = partition.MatrixOp("te_jax_act_fwd", _fwd_body, (act, spec, bool(pair_axis)),
                            (_x_tokens(act, pair_axis), "~", "~"), cast_tokens(spec), (m, n_out),
                            reduce=cast_reduce(spec), shard_n=pair_axis or act not in GATED)
    return CastOutputs(*partition.call(op, xm, scale_op, words))


def _pair_form(outs, n_lead: int) -> tuple:
    """Kernel results of a ``[m, 2f]`` gradient with the pair axis: ``[m, 2, f]``, ``[2, f, m]``, dbias ``[2, f]``."""
    q, s, q_t, s_t, *rest, dbias = outs

    def rows(a):
        return a.reshape(*a.shape[:-1], 2, -1) if a.ndim == n_lead + 2 else a

    def cols(a):
        return a.reshape(*a.shape[:-2], 2, -1, a.shape[-1]) if a.ndim == n_lead + 2 else a

    dbias = dbias.reshape(*dbias.shape[:-1], 2, -1) if dbias.shape[-1] else dbias
    return (rows(q), rows(s), cols(q_t), cols(s_t), *rest, dbias)


def _bwd_body(op, shards, dy, x, scale, words):
    act, spec, dbias, pair_axis = op.config
    if pair_axis:
        x = x.reshape(*x.shape[:-2], -1)
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
    dy2 = dy.reshape(m, n_out).astype(ct)
    if backend_lib.resolve(backend) == "reference":
        outs = rna.act_bwd(dy2, xm.reshape(m, n), scale_op, words, act=act, spec=spec, dbias=bool(dbias))
        outs = _pair_form(outs, 0) if pair_axis else outs
    else:
        gated_flat = act in GATED and not pair_axis
        cols = ("~", "n") if pair_axis else (("~",) if gated_flat else ("n",))
        dbias_tokens = " ".join(cols) if dbias else "~"
        op = partition.MatrixOp(
            "te_jax_act_bwd", _bwd_body, (act, spec, bool(dbias), bool(pair_axis)),
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
        return a.reshape(a.shape[0], -1) if a.ndim == 3 else a

    def cols(a):
        return a.reshape(-1, a.shape[-1]) if a.ndim == 3 else a

    return outs._replace(q=rows(outs.q), s=rows(outs.s), q_t=cols(outs.q_t), s_t=cols(outs.s_t))


def _unquantized(x, act, pair_axis, backend):
    outs = act_fwd(x, act=act, spec=CastSpec("none", x.dtype), pair_axis=pair_axis, backend=backend)
    return outs.q.reshape(out_shape(x, act, pair_axis))


def _unquantized_grad(dy, x, act, pair_axis, backend):
    outs, _ = act_bwd(dy, x, act=act, spec=CastSpec("none", x.dtype), pair_axis=pair_axis, backend=backend)
    return outs.q.reshape(x.shape)


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


__all__ = ["ACTIVATIONS", "DBIAS_ROWS", "GATED", "act_bwd", "act_fwd", "apply_activation", "check_act_args",
           "matrix_form", "out_shape"]
