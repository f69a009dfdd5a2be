"""GEMM op: FP8, Float8-block, MXFP8 and NVFP4 matrix products as FFI custom calls.

Two layers (the contract is ``docs/gemm_ffi.md``):

* ``gemm_fp8``, ``gemm_fp8_block``, ``gemm_mxfp8``, ``gemm_nvfp4`` take the
  contraction-last operands ``A [..., M, K]`` and ``B [N, K]`` (or
  ``[..., N, K]`` with A's leading axes: a batched GEMM) with their scales, in
  the custom call's argument order, and return ``out [..., M, N]``. Each
  validates at trace time, zero pads its operands to the shapes every handler
  takes (``te_jax.ops.gemm_call.aligned``: M, N multiples of 16, whole K
  blocks; a partial last K block needs its own scale column), then runs the
  ``te_jax_gemm_*`` custom call or, with the "reference" backend, its pure-JAX
  twin (dequantize, float32 matmul), and cuts the output back to ``[..., M, N]``.
* ``gemm(lhs, rhs, contracting_dims, batch_dims)`` multiplies ScaledTensors like
  ``lax.dot_general``, picking the rowwise or columnwise copy of each.

The custom call itself (a primitive lowered per platform, partitioned and
batched) lives in ``te_jax.ops.gemm_call``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax.ops.primitive import resolve as resolve_backend
from te_jax.ops.gemm_call import CUBLAS_WORKSPACE_BYTES, Layout, aligned, call, workspace_bytes
from te_jax.ops.dequantize import dequantize
from te_jax.spec import modes
from te_jax.spec import numerics as nm
from te_jax.spec import reference as ref
from te_jax.spec.modes import ScalingMode
from te_jax.spec.modes import ScaledTensor
from te_jax.ops.sharding import MeshResource
from te_jax.ops.sharding_types import dot_general as typed_dot, reshape as typed_reshape

__all__ = ["CUBLAS_WORKSPACE_BYTES", "gemm", "gemm_fp8", "gemm_fp8_block", "gemm_mxfp8", "gemm_nvfp4",
           "workspace_bytes"]
OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ---- validation and the four custom calls ----------------------------------------------


def check_operand_dtypes(a, b, mode: str) -> None:
    """FP8 operands (not both E5M2), or packed uint8 for NVFP4 (``mode`` is the mode's label)."""
    nvfp4 = mode == modes.NVFP4.label
    if nvfp4 and not a.dtype == b.dtype == jnp.uint8:
        raise TypeError(f"te_jax: NVFP4 GEMM operands must be packed uint8, got {a.dtype} and {b.dtype}")
    if not nvfp4 and not {jnp.dtype(a.dtype), jnp.dtype(b.dtype)} <= {jnp.dtype(d) for d in nm.FP8_DTYPES}:
        raise TypeError(f"te_jax: FP8 GEMM operands must be float8_e4m3fn or float8_e5m2, got {a.dtype}, {b.dtype}")
    if a.dtype == b.dtype == jnp.float8_e5m2:
        raise TypeError("te_jax: E5M2 x E5M2 GEMMs are not supported; quantize one operand as E4M3 "
                        "(Format.HYBRID keeps E5M2 for gradients only)")


def _check_operands(a, b, *, mode: str) -> int:
    """A [..., M, K] and B [N, K] or [..., N, K] (NVFP4: packed, K/2 columns); returns K."""
    check_operand_dtypes(a, b, mode)
    nvfp4 = mode == modes.NVFP4.label
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"te_jax: GEMM operands must be A [..., M, K] and B [..., N, K] with one K; "
                         f"got {a.shape} and {b.shape}")
    if b.ndim > 2 and b.shape[:-2] != a.shape[:-2]:
        raise ValueError(f"te_jax: a batched B {b.shape} must have A's leading axes {a.shape[:-2]}")
    return a.shape[-1] * (2 if nvfp4 else 1)


def check_block_scales(s, data, k: int, rows: int, k_block: int, dtype, name: str):
    """Checks block scales ``[..., ceil(R/rows), ceil(K/k_block)]`` of ``data [..., R, K]``."""
    want = (*data.shape[:-2], -(-data.shape[-2] // rows), -(-k // k_block))
    if tuple(s.shape) != want or jnp.dtype(s.dtype) != jnp.dtype(dtype):
        raise ValueError(f"te_jax: {name} must be {jnp.dtype(dtype)}{list(want)}, got {s.dtype}{list(s.shape)}")
    return s


def _tensor_scale(s, data, name: str):
    """A float32 value for all of ``data`` (``[1]``) or one per matrix (``[..., 1]``): (value, role)."""
    s, side = jnp.asarray(s, jnp.float32), name[0]
    if data.ndim > 2 and s.shape == (*data.shape[:-2], 1):
        return s, f"{side}_tm"
    if s.size != 1:
        raise ValueError(f"te_jax: {name} must be float32 [1] or one value per matrix {[*data.shape[:-2], 1]}, "
                         f"got shape {s.shape}")
    return s.reshape(1), f"{side}_t"


def check_out_dtype(out_dtype) -> jnp.dtype:
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise TypeError(f"te_jax: GEMM out_dtype must be float32, bfloat16 or float16, not {out_dtype}")
    return jnp.dtype(out_dtype)


def check_flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"te_jax: GEMM {name} must be True or False, got {value!r}")
    return bool(value)


def _empty_product(a, m: int, n: int, bias, out_dtype) -> jax.Array:
    """A product with M, N or K of size 0, as ``lax.dot_general`` gives it: an empty output, or (K = 0) zeros
    plus the bias. No kernel runs (the handlers take no empty operands)."""
    out = jnp.zeros((*a.shape[:-2], m, n), jnp.float32)
    return (out if bias is None else out + bias.astype(jnp.float32)).astype(out_dtype)


def _run(lay: Layout, args: tuple, dequantize, bias, out_dtype, autotune: bool, backend, mesh_resource):
    """Checks out_dtype and bias, then runs the custom call or its reference twin."""
    out_dtype, autotune = check_out_dtype(out_dtype), check_flag("autotune", autotune)
    a, b = args[lay.roles.index("a")], args[lay.roles.index("b")]
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (b.shape[-2],):
            raise ValueError(f"te_jax: bias must be [N] = [{b.shape[-2]}], got shape {bias.shape}")
        if jnp.dtype(bias.dtype) not in (out_dtype, jnp.dtype(jnp.float32)):
            bias = bias.astype(jnp.float32)
    m, n = a.shape[-2], b.shape[-2]
    if 0 in (m, n, a.shape[-1]):
        return _empty_product(a, m, n, bias, out_dtype)
    args, bias = aligned(lay, args, bias)
    if resolve_backend(backend) == "reference":
        da, db = dequantize(*args)
        batch = tuple(range(db.ndim - 2))  # a batched B shares A's leading axes
        out = typed_dot(da, db, (((da.ndim - 1,), (db.ndim - 1,)), (batch, batch)), precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)  # typed where lax refuses (Explicit meshes)
        out = (out if bias is None else out + bias.astype(jnp.float32)).astype(out_dtype)
    else:
        lay = dataclasses.replace(lay, attrs=(*lay.attrs, ("autotune", autotune)), out_dtype=out_dtype,
                                  has_bias=bias is not None, n_lead=a.ndim - 2, b_batched=b.ndim > 2)
        out = call(lay, *args, *(() if bias is None else (bias,)), mesh_resource=mesh_resource)
    return out if out.shape[-2:] == (m, n) else out[..., :m, :n]


def gemm_fp8(a, b, a_scale_inv, b_scale_inv, bias=None, *, out_dtype=jnp.bfloat16, fast_accum=True, autotune=False,
             backend=None, mesh_resource: MeshResource | None = None):
    """Per-tensor FP8: ``out = cast((a * a_scale_inv) @ (b * b_scale_inv)^T + bias)``.

    Args:
      a: FP8 ``[..., M, K]``; b: FP8 ``[N, K]`` or ``[..., N, K]`` (not both E5M2).
      a_scale_inv, b_scale_inv: float32 decode scales, ``[1]`` or one per matrix ``[..., 1]``.
      bias: ``[N]`` (out_dtype or float32) or None. out_dtype: float32, bfloat16 or float16.
      fast_accum: Hopper FP8 fast accumulation (ignored on CPU).
      autotune: time cuBLASLt's candidate algorithms when this GEMM configuration is first run and keep the
        fastest (ignored on CPU). Off: cuBLASLt's heuristic choice, the same algorithm (and result bits) in
        every run.
      backend: "ffi" or "reference" (default: ``te_jax.ops.backend``'s context).
      mesh_resource: under sharding, the tensor / sequence parallel axes: a
        weight split over them stays split along N, and sequence-parallel
        partial products are reduce-scattered over M (None: neither).
    """
    _check_operands(a, b, mode=modes.FP8_TENSOR.label)
    (a_scale_inv, ra), (b_scale_inv, rb) = _tensor_scale(a_scale_inv, a, "a_scale_inv"), _tensor_scale(
        b_scale_inv, b, "b_scale_inv")
    deq = lambda a, b, sa, sb: (ref.dequantize_fp8_tensor(a, sa), ref.dequantize_fp8_tensor(b, sb))  # noqa: E731
    lay = Layout(modes.FP8_TENSOR.gemm_target, ("a", "b", ra, rb),
                 attrs=(("fast_accum", check_flag("fast_accum", fast_accum)),))
    return _run(lay, (a, b, a_scale_inv, b_scale_inv), deq, bias, out_dtype, autotune, backend, mesh_resource)


def gemm_fp8_block(a, a_s, b, b_s, bias=None, *, a_block_2d=False, b_block_2d=False, out_dtype=jnp.bfloat16,
                   autotune=False, backend=None, mesh_resource: MeshResource | None = None):
    """Float8 block scaling: float32 1/scale per 1x128 block, or per 128x128 block when ``*_block_2d``.

    ``a_s`` is ``[..., M, ceil(K/128)]`` (2D: ``[..., ceil(M/128), ceil(K/128)]``), ``b_s``
    likewise for B; 128x128 x 128x128 is refused. Other args as ``gemm_fp8``;
    there is no ``fast_accum``: the block-scaled kernels promote every
    128-long K block into float32 sums.
    """
    block = modes.FP8_BLOCK.block_cols
    k = _check_operands(a, b, mode=modes.FP8_BLOCK.label)
    if a_block_2d and b_block_2d:
        raise ValueError("te_jax: 128x128 x 128x128 block-scaled GEMMs are not supported; quantize one operand "
                         "with 1x128 blocks (Float8BlockQuantizer(block_2d=False))")
    ra, rb = (block if a_block_2d else 1), (block if b_block_2d else 1)
    a_s = check_block_scales(a_s, a, k, ra, block, modes.FP8_BLOCK.scale_dtype, "a_s")
    b_s = check_block_scales(b_s, b, k, rb, block, modes.FP8_BLOCK.scale_dtype, "b_s")
    deq = lambda a, sa, b, sb: (ref.dequantize_fp8_block(a, sa, block_2d=a_block_2d),  # noqa: E731
                                ref.dequantize_fp8_block(b, sb, block_2d=b_block_2d))
    lay = Layout(modes.FP8_BLOCK.gemm_target, ("a", "a_s", "b", "b_s"), k_block=block, a_rows=ra, b_rows=rb,
                 attrs=(("a_block_2d", bool(a_block_2d)), ("b_block_2d", bool(b_block_2d))))
    return _run(lay, (a, a_s, b, b_s), deq, bias, out_dtype, autotune, backend, mesh_resource)


def gemm_mxfp8(a, a_s, b, b_s, bias=None, *, out_dtype=jnp.bfloat16, autotune=False, backend=None,
               mesh_resource: MeshResource | None = None):
    """MXFP8: uint8 E8M0 scales ``a_s [..., M, ceil(K/32)]``, ``b_s [..., N, ceil(K/32)]``.

    Other args as ``gemm_fp8``; there is no ``fast_accum``: the sums are
    float32 (block-scaled MMA on sm_100, a bfloat16 GEMM on sm_90).
    """
    mode = modes.MXFP8
    k = _check_operands(a, b, mode=mode.label)
    a_s = check_block_scales(a_s, a, k, 1, mode.block_cols, mode.scale_dtype, "a_s")
    b_s = check_block_scales(b_s, b, k, 1, mode.block_cols, mode.scale_dtype, "b_s")
    deq = lambda a, sa, b, sb: (ref.dequantize_mxfp8(a, sa), ref.dequantize_mxfp8(b, sb))  # noqa: E731
    lay = Layout(mode.gemm_target, ("a", "a_s", "b", "b_s"), k_block=mode.block_cols)
    return _run(lay, (a, a_s, b, b_s), deq, bias, out_dtype, autotune, backend, mesh_resource)


def gemm_nvfp4(a, a_s, a_amax, b, b_s, b_amax, bias=None, *, out_dtype=jnp.bfloat16, autotune=False,
               backend=None, mesh_resource: MeshResource | None = None):
    """NVFP4: packed E2M1 ``a [..., M, K/2]`` (uint8), E4M3 scales ``a_s [..., M, ceil(K/16)]``, amax ``[1]``.

    An amax may also be one value per matrix ``[..., 1]``. Each operand
    decodes as ``e2m1 * s_b * S_dec`` with ``S_dec = 1 /
    nvfp4_global_encode_scale(amax)``. Other args as ``gemm_fp8``; there is no
    ``fast_accum`` (float32 sums, as ``gemm_mxfp8``).
    """
    mode = modes.NVFP4
    k = _check_operands(a, b, mode=mode.label)
    a_s = check_block_scales(a_s, a, k, 1, mode.block_cols, mode.scale_dtype, "a_s")
    b_s = check_block_scales(b_s, b, k, 1, mode.block_cols, mode.scale_dtype, "b_s")
    (a_amax, ra), (b_amax, rb) = _tensor_scale(a_amax, a, "a_amax"), _tensor_scale(b_amax, b, "b_amax")
    deq = lambda a, sa, ma, b, sb, mb: (ref.dequantize_nvfp4(a, sa, ma), ref.dequantize_nvfp4(b, sb, mb))  # noqa: E731
    lay = Layout(mode.gemm_target, ("a", "a_s", ra, "b", "b_s", rb), pack=mode.pack, k_block=mode.block_cols)
    return _run(lay, (a, a_s, a_amax, b, b_s, b_amax), deq, bias, out_dtype, autotune, backend, mesh_resource)


# ---- dot_general on ScaledTensors ------------------------------------------------------


class _Operand(NamedTuple):
    """One ScaledTensor as a contraction-last GEMM operand ``[*batch, rows, K]``."""

    data: jax.Array
    scale: jax.Array | None
    amax: jax.Array | None
    free_shape: tuple[int, ...]
    colwise: bool


def _normalize(dims, ndim: int) -> tuple[int, ...]:
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if not all(-ndim <= int(d) < ndim for d in dims) or len({int(d) % ndim for d in dims}) != len(dims):
        raise ValueError(f"te_jax: dims {dims} are not distinct axes of a rank-{ndim} operand")
    return tuple(int(d) % ndim for d in dims)


def _pick(t: ScaledTensor, contract: tuple[int, ...], batch: tuple[int, ...], side: str) -> _Operand:
    """The copy of ``t`` whose rows run along ``contract``, reshaped to ``[*batch, rows, K]``."""
    nd, nb = len(t.shape), len(batch)
    f = t.flatten_axis % nd
    if set(contract) == set(range(f, nd)):
        colwise, batch_axes, free = False, tuple(range(nb)), tuple(range(nb, f))
    elif set(contract) == set(range(f)):
        colwise, batch_axes, free = True, tuple(range(f, f + nb)), tuple(range(f + nb, nd))
    else:
        raise ValueError(
            f"te_jax: {side} contracts axes {contract} of a ScaledTensor of shape {t.shape} with flatten_axis={f}; "
            f"a quantized operand contracts either all axes from flatten_axis on {tuple(range(f, nd))} (rowwise "
            f"copy) or all axes before it {tuple(range(f))} (columnwise copy). Quantize with a matching flatten_axis."
        )
    if set(batch) != set(batch_axes):
        raise ValueError(f"te_jax: {side} batch axes {batch} must be {batch_axes}: the axes next to the contraction "
                         f"that lead the {'columnwise' if colwise else 'rowwise'} copy")
    if not (t.has_colwise if colwise else t.has_rowwise):
        which, flag = ("columnwise", "colwise") if colwise else ("rowwise", "rowwise")
        raise ValueError(f"te_jax: {side} contracts axes {contract}, which needs the {which} copy of the ScaledTensor, "
                         f"but it has none; quantize it with {flag}=True")
    data, scale = (t.colwise_data, t.colwise_scale_inv) if colwise else (t.data, t.scale_inv)
    lead = tuple(t.shape[i] for i in batch_axes)
    data = data.reshape(*lead, math.prod(t.shape[i] for i in free), data.shape[-1])  # explicit rows: 0-size axes
    spec = t.scaling_mode
    if not spec.per_tensor:
        rows_per_scale = spec.rows_per_scale_row
        if lead and data.shape[-2] % rows_per_scale:
            raise ValueError(f"te_jax: {side}: batching 2D-block scales needs the rows per batch element "
                             f"({data.shape[-2]}) to be a multiple of {rows_per_scale}")
        scale = scale.reshape(*lead, -(-data.shape[-2] // rows_per_scale), scale.shape[-1])
    amax = t.colwise_amax if colwise and spec.global_amax else t.amax
    return _Operand(data, scale, amax, tuple(t.shape[i] for i in free), colwise)


def _gemm_scaled(lhs: ScaledTensor, rhs: ScaledTensor, lc, rc, lb, rb, bias, fast_accum, **kw) -> jax.Array:
    if lhs.mode is not rhs.mode:
        raise ValueError(f"te_jax: both GEMM operands must use one scaling mode, got {lhs.mode.name} x "
                         f"{rhs.mode.name}; quantize them with the same recipe")
    if list(np.argsort(lc)) != list(np.argsort(rc)) or lb != tuple(sorted(lb)) or rb != tuple(sorted(rb)):
        raise ValueError(f"te_jax: quantized GEMMs need contracting dims {lc}, {rc} paired in the same axis order on "
                         f"both sides and batch dims {lb}, {rb} in ascending order; reorder them")
    a, b = _pick(lhs, lc, lb, "lhs"), _pick(rhs, rc, rb, "rhs")
    mode = lhs.mode
    if fast_accum is None:
        fast_accum = mode is ScalingMode.FP8_TENSOR
    if mode is ScalingMode.FP8_TENSOR:
        out = gemm_fp8(a.data, b.data, a.scale, b.scale, bias, fast_accum=check_flag("fast_accum", fast_accum), **kw)
    elif check_flag("fast_accum", fast_accum):
        raise ValueError(f"te_jax: fast_accum=True does not apply to {mode.name} GEMMs: they always accumulate in "
                         "float32 (block-scaled kernels promote every block; MXFP8 and NVFP4 run as block-scaled MMA "
                         "on sm_100 and as a bfloat16 GEMM on sm_90); pass fast_accum=None or False")
    elif mode is ScalingMode.FP8_BLOCK:
        out = gemm_fp8_block(a.data, a.scale, b.data, b.scale, bias, a_block_2d=lhs.block_2d,
                             b_block_2d=rhs.block_2d, **kw)
    elif mode is ScalingMode.MXFP8:
        out = gemm_mxfp8(a.data, a.scale, b.data, b.scale, bias, **kw)
    else:
        a_rht, b_rht = lhs.rht and a.colwise, rhs.rht and b.colwise
        if a_rht != b_rht:
            raise ValueError("te_jax: an NVFP4 columnwise copy with the random Hadamard transform (rht=True) can only "
                             "be multiplied with another one (the transforms cancel); quantize both wgrad operands "
                             "with rht=True, or neither")
        out = gemm_nvfp4(a.data, a.scale, a.amax, b.data, b.scale, b.amax, bias, **kw)
    # [.., M, N] to the free axes, typed also where jax's rule refuses (several split groups: Explicit meshes)
    return typed_reshape(out, (*out.shape[:-2], *a.free_shape, *b.free_shape))


def gemm(lhs, rhs, contracting_dims=((-1,), (0,)), batch_dims=((), ()), *, out_dtype=jnp.bfloat16, bias=None,
         fast_accum: bool | None = None, autotune: bool = False, backend=None,
         mesh_resource: MeshResource | None = None) -> jax.Array:
    """``lax.dot_general`` of quantized operands through the GEMM custom calls.

    Each ScaledTensor contributes the copy whose rows run along the
    contraction: contracting the axes from its ``flatten_axis`` on uses the
    rowwise copy, contracting the axes before it the columnwise copy (so
    ``x @ W``, ``dy @ W^T`` and ``x^T @ dy`` all work from one quantization).
    Batch axes must lead that copy. Both operands must share a ScalingMode;
    NVFP4 columnwise copies with the Hadamard transform pair only with each other.

    If exactly one operand is a ScaledTensor (a custom recipe left the other
    in high precision), it is dequantized to float32 and multiplied with
    ``lax.dot_general`` at HIGHEST precision, accumulating in float32; if
    neither is, this is a plain ``lax.dot_general`` accumulating in float32.

    Args:
      lhs, rhs: ScaledTensors or float32/bfloat16/float16 arrays.
      contracting_dims: ``((lhs axes), (rhs axes))``, paired in order.
      batch_dims: ``((lhs axes), (rhs axes))``.
      out_dtype: float32, bfloat16 or float16.
      bias: ``[N]`` or the shape of rhs's free axes, added in float32, or None.
      fast_accum: Hopper FP8 fast accumulation of a per-tensor FP8 GEMM (ignored on CPU). None: the mode's
        default, True for per-tensor FP8 and False for the block modes, which always accumulate in float32 and
        raise ValueError on True.
      autotune: time cuBLASLt's candidate algorithms when a GEMM configuration first runs and keep the fastest
        (ignored on CPU). Off by default: cuBLASLt's heuristic choice, the same result bits in every run.
      backend: "ffi" or "reference" (default: ``te_jax.ops.backend``'s context).
      mesh_resource: the tensor / sequence parallel axes for a sharded GEMM
        (see ``gemm_fp8``); the functional layers pass their autocast's.

    Returns:
      ``[*batch, *lhs free axes, *rhs free axes]`` in ``out_dtype``.
    """
    lq, rq = isinstance(lhs, ScaledTensor), isinstance(rhs, ScaledTensor)
    (lc, rc), (lb, rb) = ([_normalize(d, len(t.shape)) for d, t in zip(dims, (lhs, rhs))]
                          for dims in (contracting_dims, batch_dims))
    if (len(lc) != len(rc) or len(lb) != len(rb) or not lc or set(lc) & set(lb) or set(rc) & set(rb)
            or [lhs.shape[i] for i in lc + lb] != [rhs.shape[j] for j in rc + rb]):
        raise ValueError(f"te_jax: contracting dims {contracting_dims} and batch dims {batch_dims} do not pair "
                         f"equal-sized, distinct axes of lhs {lhs.shape} and rhs {rhs.shape}")
    rhs_free = tuple(d for i, d in enumerate(rhs.shape) if i not in rc + rb)
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape not in ((math.prod(rhs_free),), rhs_free):
            raise ValueError(f"te_jax: bias must be [N] = [{math.prod(rhs_free)}] or {rhs_free}, got {bias.shape}")
        bias = bias.reshape(-1)
    if fast_accum is not None:
        check_flag("fast_accum", fast_accum)
    check_flag("autotune", autotune)
    if lq and rq:
        return _gemm_scaled(lhs, rhs, lc, rc, lb, rb, bias, fast_accum, out_dtype=out_dtype, autotune=autotune,
                            backend=backend, mesh_resource=mesh_resource)
    out_dtype = check_out_dtype(out_dtype)
    lhs = dequantize(lhs, jnp.float32, backend=backend) if lq else lhs
    rhs = dequantize(rhs, jnp.float32, backend=backend) if rq else rhs
    out = typed_dot(lhs, rhs, ((lc, rc), (lb, rb)), precision=lax.Precision.HIGHEST if lq or rq else None,
                    preferred_element_type=jnp.float32)  # lax's, typed also where lax refuses (Explicit meshes)
    if bias is not None:
        out = out + bias.astype(jnp.float32).reshape(rhs_free)
    return out.astype(out_dtype)
