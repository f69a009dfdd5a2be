"""Dequantize ops: per-mode FFI custom calls with pure-JAX reference twins, and ScaledTensor values.

``dequantize_fp8_tensor`` / ``_mxfp8`` / ``_fp8_block`` / ``_nvfp4`` decode one
copy ``[..., M, N]`` (NVFP4: packed ``[..., M, N/2]``) of a scaling mode,
validating at trace time, through the ``te_jax_dequantize_*`` custom call
(``te_jax.ops.primitive``: partitioned like the data, block scales following
it) or, with the "reference" backend, ``te_jax.spec.reference``.
``dequantize`` / ``dequantize_colwise`` give the values of a ScaledTensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import te_jax.ops.ffi  # noqa: F401  (registers the FFI targets)
from te_jax.ops import primitive as partition
from te_jax.ops.quantize import FP8_BLOCK, HIGH_PRECISION_DTYPES, _fp8_block_mode, _rows, pad_to_blocks
from te_jax.spec import modes
from te_jax.spec import numerics as nm
from te_jax.spec import reference as ref
from te_jax.spec.modes import ScaledTensor

__all__ = ["dequantize", "dequantize_colwise", "dequantize_fp8_block", "dequantize_fp8_tensor", "dequantize_matrix",
           "dequantize_mxfp8", "dequantize_nvfp4"]


def _check_out_dtype(out_dtype) -> jnp.dtype:
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"te_jax: dequantize produces float32, bfloat16 or float16, not {out_dtype}")
    return out_dtype


def _check_quantized(q, dtypes, what: str) -> None:
    if q.ndim < 2:
        raise ValueError(f"te_jax: quantized data must be a matrix [..., M, N], got shape {q.shape}")
    if jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in dtypes]:
        raise TypeError(f"te_jax: {what} data must be {', '.join(str(jnp.dtype(d)) for d in dtypes)}, got {q.dtype}")


def _dequantize_body(op, shards, q, *scales):
    out_dtype, attrs, pack = op.config
    shape = (*q.shape[:-1], q.shape[-1] * pack)
    return tuple(partition.ffi(op.target, jax.ShapeDtypeStruct(shape, out_dtype), q, *scales, **dict(attrs)))


def _dequantize(mode: modes.ModeSpec, out_dtype, attrs: tuple, operands: tuple[str, ...], q, *scales):
    """The dequantize custom call of ``mode``, partitioned like its data (block scales follow it)."""
    op = partition.MatrixOp(mode.dequantize_target, _dequantize_body, (out_dtype, attrs, mode.pack), operands,
                            ("m n",), (q.shape[-2], q.shape[-1] * mode.pack))
    return partition.call(op, q, *scales)[0]


def dequantize_fp8_tensor(q, scale_inv, *, out_dtype=jnp.float32, backend=None):
    """``q * scale_inv`` for per-tensor FP8 (``scale_inv [..., 1]``)."""
    _check_quantized(q, nm.FP8_DTYPES, "per-tensor FP8")
    out_dtype = _check_out_dtype(out_dtype)
    scale_inv = jnp.asarray(scale_inv, jnp.float32).reshape(*q.shape[:-2], 1)
    if partition.resolve(backend) == "reference":
        return ref.dequantize_fp8_tensor(q, scale_inv, out_dtype=out_dtype)
    return _dequantize(modes.FP8_TENSOR, out_dtype, (), ("m n", "~"), q, scale_inv)


def dequantize_mxfp8(q, s, *, out_dtype=jnp.float32, backend=None):
    _check_quantized(q, nm.FP8_DTYPES, "MXFP8")
    out_dtype = _check_out_dtype(out_dtype)
    modes.MXFP8.check_tiles(q.shape, rowwise=True, colwise=False)
    if partition.resolve(backend) == "reference":
        return ref.dequantize_mxfp8(q, s, out_dtype=out_dtype)
    return _dequantize(modes.MXFP8, out_dtype, (), ("m n", "m n/32"), q, s.astype(jnp.uint8))


def dequantize_fp8_block(q, s, *, block_2d=False, out_dtype=jnp.float32, backend=None):
    """Float8 block codes ``[..., M, N]`` (N whole blocks; 2D blocks: any M, scales ``[..., ceil(M/128), N/128]``)."""
    _check_quantized(q, nm.FP8_DTYPES, "Float8 block")
    out_dtype = _check_out_dtype(out_dtype)
    rows = q.shape[-2]
    q = pad_to_blocks(q, FP8_BLOCK if block_2d else 1, 1)  # a partial 2D block's rows decode with its scale
    _fp8_block_mode(block_2d).check_tiles(q.shape, rowwise=True, colwise=False)
    if partition.resolve(backend) == "reference":
        return _rows(ref.dequantize_fp8_block(q, s, block_2d=block_2d, out_dtype=out_dtype), rows)
    scales = "m/128 n/128" if block_2d else "m n/128"
    return _rows(_dequantize(_fp8_block_mode(block_2d), out_dtype, (("block_2d", bool(block_2d)),),
                             ("m n", scales), q, s.astype(jnp.float32)), rows)


def dequantize_nvfp4(q, s, amax, *, out_dtype=jnp.float32, backend=None):
    """NVFP4 packed codes ``[..., M, N/2]`` back to ``[..., M, N]`` values."""
    _check_quantized(q, (jnp.uint8,), "NVFP4")
    out_dtype = _check_out_dtype(out_dtype)
    amax = jnp.asarray(amax, jnp.float32).reshape(*q.shape[:-2], 1)
    if partition.resolve(backend) == "reference":
        return ref.dequantize_nvfp4(q, s, amax, out_dtype=out_dtype)
    return _dequantize(modes.NVFP4, out_dtype, (), ("m n/2", "m n/16", "~"), q, s, amax)


# The dequantize op of each registry entry, called as ``(data, scales, amax, **kw)``.
_DEQUANTIZE = {
    "fp8_tensor": lambda q, s, amax, **kw: dequantize_fp8_tensor(q, s, **kw),
    "mxfp8": lambda q, s, amax, **kw: dequantize_mxfp8(q, s, **kw),
    "fp8_block": lambda q, s, amax, **kw: dequantize_fp8_block(q, s, block_2d=False, **kw),
    "fp8_block_2d": lambda q, s, amax, **kw: dequantize_fp8_block(q, s, block_2d=True, **kw),
    "nvfp4": dequantize_nvfp4,
    "nvfp4_2d": dequantize_nvfp4,
}


def dequantize_matrix(mode: modes.ModeSpec, data, scales, amax=None, *, out_dtype=jnp.float32, backend=None):
    """Dequantizes one copy ``[..., M, N]`` (NVFP4: packed ``[..., M, N/2]``) of a tensor of scaling mode ``mode``.

    ``amax`` is the copy's global amax (NVFP4) and is ignored by the other modes.
    """
    return _DEQUANTIZE[mode.name](data, scales, amax, out_dtype=out_dtype, backend=backend)


def dequantize(t: ScaledTensor, dtype=jnp.float32, backend: str | None = None) -> jax.Array:
    """The values ``t`` represents, in its logical shape (from the rowwise copy if present)."""
    if t.has_rowwise:
        values = dequantize_matrix(t.scaling_mode, t.data, t.scale_inv, t.amax, out_dtype=dtype, backend=backend)
        values = _first_columns(values, t.matrix_shape[1])
    else:
        values = jnp.swapaxes(dequantize_colwise(t, dtype, backend, undo_rht=True), -1, -2)
    return values.reshape(*values.shape[:-2], *t.shape)


def dequantize_colwise(t: ScaledTensor, dtype=jnp.float32, backend: str | None = None,
                       undo_rht: bool = False) -> jax.Array:
    """The columnwise copy's values of ``t`` as the matrix ``[N, M]``.

    With ``t.rht`` these are Hadamard-domain values unless ``undo_rht``:
    then a partial 16-group's transformed padding is part of them, so
    they are ``[N, M']`` with ``M'`` rounded up to whole groups.
    """
    if not t.has_colwise:
        raise ValueError("te_jax: this ScaledTensor has no columnwise copy")
    amax = t.colwise_amax if t.scaling_mode.global_amax else t.amax
    values = dequantize_matrix(t.scaling_mode, t.colwise_data, t.colwise_scale_inv, amax, out_dtype=jnp.float32,
                               backend=backend)
    if t.rht and not undo_rht:
        return values.astype(dtype)
    if t.rht:
        values = nm.inverse_rht16(values)
    return _first_columns(values, t.matrix_shape[0]).astype(dtype)


def _first_columns(values: jax.Array, count: int) -> jax.Array:
    """``values [..., R, C]`` without the block padding after column ``count`` (as it is when there is none)."""
    return values if values.shape[-1] == count else values[..., :count]
