"""Pure-JAX reference quantizers: the executable spec of every kernel.

Each function takes ``x`` of shape ``[..., M, N]`` (float32, bfloat16 or
float16), treats the leading axes as a batch, and returns exactly what the
matching ``te_jax_quantize_*`` custom call writes. The columnwise copy of a
mode is always its rowwise quantization of ``swapaxes(x, -1, -2)``, so it is
the transposed (``[..., N, M]``) tensor that the TN GEMM layout needs.
Outputs that were not asked for come back as empty ``[..., 0]`` arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax.spec import numerics as nm

MXFP8_BLOCK = nm.MXFP8_BLOCK
NVFP4_BLOCK = nm.NVFP4_BLOCK
FP8_BLOCK = nm.FP8_BLOCK


def _empty(x: jax.Array, dtype) -> jax.Array:
    return jnp.zeros((*x.shape[:-2], 0), dtype)


def _t(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _unblocks(x: jax.Array) -> jax.Array:
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


# ---- per-tensor FP8 ------------------------------------------------------------


def quantize_fp8_tensor(x, scale, *, qdtype, rowwise=True, colwise=False):
    """Per-tensor FP8 with a given scale ``[..., 1]``.

    Returns ``(q [...,M,N], q_t [...,N,M], amax [...,1], scale_inv [...,1])``.
    """
    xf = x.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    q = nm.cast_fp8(xf * scale[..., None], qdtype)
    amax = nm.abs_max(xf, axis=(-2, -1))[..., None]
    return (
        q if rowwise else _empty(x, qdtype),
        _t(q) if colwise else _empty(x, qdtype),
        amax,
        nm.reciprocal(scale),
    )


def quantize_fp8_current(x, *, qdtype, rowwise=True, colwise=False, power_2=False, epsilon=0.0):
    """Per-tensor current scaling: amax, scale from it, then the cast.

    Returns ``(q, q_t, amax, scale, scale_inv)``.
    """
    amax = nm.abs_max(x, axis=(-2, -1))[..., None]
    scale = nm.scale_from_amax(amax, nm.fp8_max(qdtype), epsilon, power_2)
    q, q_t, _, scale_inv = quantize_fp8_tensor(x, scale, qdtype=qdtype, rowwise=rowwise, colwise=colwise)
    return q, q_t, amax, scale, scale_inv


# ---- MXFP8 ---------------------------------------------------------------------


def _mxfp8_rowwise(x, qdtype):
    xb = _blocks(x.astype(jnp.float32), MXFP8_BLOCK)
    codes = nm.e8m0_from_amax(nm.abs_max(xb, axis=-1), nm.fp8_max(qdtype))
    q = nm.cast_fp8(xb * nm.e8m0_inverse_to_float(codes)[..., None], qdtype)
    return _unblocks(q), codes


def quantize_mxfp8(x, *, qdtype, rowwise=True, colwise=False):
    """MXFP8: 1x32 blocks with E8M0 scales (uint8 codes).

    Returns ``(q [...,M,N], s [...,M,N/32], q_t [...,N,M], s_t [...,N,M/32])``.
    """
    q, s = _mxfp8_rowwise(x, qdtype) if rowwise else (_empty(x, qdtype), _empty(x, jnp.uint8))
    q_t, s_t = _mxfp8_rowwise(_t(x), qdtype) if colwise else (_empty(x, qdtype), _empty(x, jnp.uint8))
    return q, s, q_t, s_t


# ---- Float8 block scaling --------------------------------------------------------


def _block_amax_2d(xf, block):
    *lead, m, n = xf.shape
    xb = xf.reshape(*lead, m // block, block, n // block, block)
    return xb, nm.abs_max(xb, axis=(-3, -1))


def _fp8_block_rowwise(x, qdtype, block_2d, power_2):
    xf = x.astype(jnp.float32)
    fmax = nm.fp8_max(qdtype)
    if block_2d:
        xb, amax = _block_amax_2d(xf, FP8_BLOCK)
        scale = nm.scale_from_amax(amax, fmax, 0.0, power_2)
        q = nm.cast_fp8(xb * scale[..., :, None, :, None], qdtype).reshape(xf.shape)
    else:
        xb = _blocks(xf, FP8_BLOCK)
        scale = nm.scale_from_amax(nm.abs_max(xb, axis=-1), fmax, 0.0, power_2)
        q = _unblocks(nm.cast_fp8(xb * scale[..., None], qdtype))
    return q, nm.reciprocal(scale)


def quantize_fp8_block(x, *, qdtype, rowwise=True, colwise=False, block_2d=False, power_2=True):
    """Float8 block scaling, 1x128 or 128x128 blocks; scales stored as float32 1/scale.

    Returns ``(q, s, q_t, s_t)``; ``s`` is ``[...,M,N/128]`` (1x128) or
    ``[...,M/128,N/128]`` (128x128), ``s_t`` likewise for ``x^T``.
    """
    empty = (_empty(x, qdtype), _empty(x, jnp.float32))
    q, s = _fp8_block_rowwise(x, qdtype, block_2d, power_2) if rowwise else empty
    q_t, s_t = _fp8_block_rowwise(_t(x), qdtype, block_2d, power_2) if colwise else empty
    return q, s, q_t, s_t


# ---- NVFP4 ---------------------------------------------------------------------


def _nvfp4_rowwise(xf, global_amax, block_2d, random_bits):
    """Quantize float32 ``xf [...,M,N]`` given its global amax ``[...,1]``."""
    s_enc = nm.nvfp4_global_encode_scale(global_amax)
    s_dec = nm.reciprocal(s_enc)
    if block_2d:
        xb, amax = _block_amax_2d(xf, NVFP4_BLOCK)
        s_b = nm.nvfp4_block_scale(amax, s_enc[..., None])
        enc = nm.nvfp4_block_encode(s_b, s_dec[..., None])
        v = (xb * enc[..., :, None, :, None]).reshape(xf.shape)
        # Stored like 1D scales: each of the block's 16 rows repeats its scale.
        s_b = jnp.repeat(s_b, NVFP4_BLOCK, axis=-2)
    else:
        xb = _blocks(xf, NVFP4_BLOCK)
        s_b = nm.nvfp4_block_scale(nm.abs_max(xb, axis=-1), s_enc[..., None])
        enc = nm.nvfp4_block_encode(s_b, s_dec[..., None])
        v = _unblocks(xb * enc[..., None])
    codes = nm.e2m1_rne(v) if random_bits is None else nm.e2m1_stochastic(v, random_bits)
    return nm.pack_nibbles(codes), s_b


def _sr_bits(key_words, stream, m, n):
    if key_words is None:
        return None
    seed = nm.stream_seed(key_words, stream)[..., None, None]
    index = jnp.arange(m * n, dtype=jnp.uint32).reshape(m, n)
    return nm.random_bits(seed, index)


def quantize_nvfp4(
    x, key_words=None, *, rowwise=True, colwise=False, block_2d=False, rht=False, stochastic_rounding=False
):
    """NVFP4: E2M1 elements packed two per byte, E4M3 block scales, float32 global amax.

    ``key_words`` (``uint32 [..., 2]``) drives stochastic rounding. ``rht``
    applies the 16-point random Hadamard transform to the columnwise copy
    (along M) before its amax and quantization.

    Returns ``(q [...,M,N/2], s [...,M,N/16], q_t [...,N,M/2], s_t [...,N,M/16],
    amax [...,1], amax_t [...,1])``.
    """
    if stochastic_rounding and key_words is None:
        raise ValueError("stochastic rounding needs key_words")
    keys = key_words if stochastic_rounding else None
    xf = x.astype(jnp.float32)
    m, n = xf.shape[-2:]
    amax = nm.abs_max(xf, axis=(-2, -1))[..., None]
    e8, e4 = jnp.uint8, jnp.float8_e4m3fn
    if rowwise:
        q, s = _nvfp4_rowwise(xf, amax, block_2d, _sr_bits(keys, nm.ROWWISE_STREAM, m, n))
    else:
        q, s = _empty(x, e8), _empty(x, e4)
    y = _t(xf)
    if rht:
        y = nm.rht16(y)
    amax_t = nm.abs_max(y, axis=(-2, -1))[..., None]
    if colwise:
        q_t, s_t = _nvfp4_rowwise(y, amax_t, block_2d, _sr_bits(keys, nm.COLWISE_STREAM, n, m))
    else:
        q_t, s_t = _empty(x, e8), _empty(x, e4)
    return q, s, q_t, s_t, amax, amax_t


# ---- dequantize ----------------------------------------------------------------


def dequantize_fp8_tensor(q, scale_inv, *, out_dtype=jnp.float32):
    return (q.astype(jnp.float32) * scale_inv.astype(jnp.float32)[..., None]).astype(out_dtype)


def dequantize_mxfp8(q, s, *, out_dtype=jnp.float32):
    v = _blocks(q.astype(jnp.float32), MXFP8_BLOCK) * nm.e8m0_to_float(s)[..., None]
    return _unblocks(v).astype(out_dtype)


def dequantize_fp8_block(q, s, *, block_2d=False, out_dtype=jnp.float32):
    qf = q.astype(jnp.float32)
    if block_2d:
        qb, _ = _block_amax_2d(qf, FP8_BLOCK)
        return (qb * s[..., :, None, :, None]).reshape(qf.shape).astype(out_dtype)
    return _unblocks(_blocks(qf, FP8_BLOCK) * s[..., None]).astype(out_dtype)


def dequantize_nvfp4(q, s, amax, *, out_dtype=jnp.float32):
    values = _blocks(nm.e2m1_to_float(nm.unpack_nibbles(q)), NVFP4_BLOCK)
    s_dec = nm.reciprocal(nm.nvfp4_global_encode_scale(amax))
    v = (values * s.astype(jnp.float32)[..., None]) * s_dec[..., None, None]
    return _unblocks(v).astype(out_dtype)
