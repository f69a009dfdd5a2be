"""Grouped GEMM op: one FP8 / Float8-block / MXFP8 / NVFP4 / bfloat16 product per group (mixture-of-experts).

Two layouts, chosen by the static ``group_axis``; ``group_sizes`` is int32
``[G]`` on the device (data dependent, zeros allowed):

* ``group_axis=0`` (forward, dgrad): ``A [M, K]`` with its rows sorted by
  group (group g is rows ``[off_g, off_g + m_g)``, ``off_g = sum_{h<g} m_h``),
  ``B [G, N, K]``; ``out [M, N]`` holds ``A_g @ B_g^T`` in group g's rows and
  zeros in the rows past ``sum(m)``. An optional bias ``[G, N]`` adds
  ``bias[g]`` to group g's rows.
* ``group_axis=1`` (wgrad): ``A [P, Kc]`` and ``B [Q, Kc]`` grouped along the
  contraction in spans aligned to ``align``: group g's span is columns
  ``[s_g, s_g + roundup(m_g, align))`` with ``s_g = sum_{h<g} roundup(m_h,
  align)``, and ``out [G, P, Q]``, ``out[g] = A_span @ B_span^T`` over the
  whole span (zeros for an empty group). The caller zero pads each group's
  data to its span before quantizing; a transform of whole spans (NVFP4's
  Hadamard transform, 16-column blocks inside a span) then makes the padding
  columns non-zero, and the products over the whole span are still the
  untransformed data's.

Groups reaching past M (past Kc) are cut there. Per-tensor values (FP8
``*_scale_inv``, NVFP4 ``*_amax``) are float32 ``[1]`` or ``[G]`` (one per
group). Block scales are as the dense GEMM's (``te_jax.ops.gemm``) for
``A`` and for each matrix of ``B``.

``grouped_gemm_bf16`` multiplies unquantized bfloat16 operands in their
natural layouts (no transposes needed by the caller; see its docstring):
``B [G, K, N]`` or ``[G, N, K]`` for group_axis 0, and for group_axis 1 (the
wgrad) ``A [R, P]``, ``B [R, Q]`` grouped along their rows, unpadded.

``grouped_gemm_fp8`` and friends take explicit operands, validate them at
trace time (``te_jax.ops.grouped.layout``) and run the
``te_jax_grouped_gemm_*`` custom call or, with the "reference" backend, the
pure-JAX twin (``te_jax.ops.grouped.reference``: dequantize as
``te_jax.spec.reference``, float32 product per group at HIGHEST
precision, bias in float32, cast). ``grouped_gemm`` multiplies ScaledTensors,
picking the rowwise or columnwise copy of each.

The custom call itself (a primitive lowered per platform, partitioned with
the experts) lives in ``te_jax.ops.grouped.call``. On a GPU, per-tensor FP8,
Float8 block and bfloat16 run the CUTLASS sm_90a kernels
(docs/grouped_gemm_cuda.md; the choice is ``te_jax.ops.grouped.cuda``);
MXFP8, NVFP4 and every mode on a GPU other than sm_90 run the emulation
(``GemmEmulationWarning``): operands dequantized to bfloat16 (bfloat16 ones
as they are), XLA's ragged dot accumulating in float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from te_jax.ops.primitive import resolve as resolve_backend
from te_jax.ops.gemm import check_block_scales, check_flag, check_operand_dtypes, check_out_dtype
from te_jax.ops.grouped.call import call
from te_jax.ops.grouped.cuda import grouped_workspace_bytes
from te_jax.ops.grouped.layout import (GROUP_ALIGN, GroupedLayout, check_bias, check_group_sizes, check_layout,
                                       group_value, grouped_positions, in_spans)
from te_jax.ops.grouped.reference import dequantize, reference
from te_jax.spec import modes
from te_jax.spec.modes import ScalingMode
from te_jax.spec.modes import ScaledTensor

__all__ = ["GROUP_ALIGN", "grouped_gemm", "grouped_gemm_bf16", "grouped_gemm_fp8", "grouped_gemm_fp8_block",
           "grouped_gemm_mxfp8", "grouped_gemm_nvfp4", "grouped_positions", "grouped_workspace_bytes", "in_spans"]


# ---- the five ops ------------------------------------------------------------------------


def _run(lay: GroupedLayout, args: tuple, group_sizes, bias, out_dtype, backend):
    """Checks out_dtype and bias, then runs the custom call or its reference twin."""
    out_dtype = check_out_dtype(out_dtype)
    num_groups = group_sizes.shape[0]
    a, b = args[lay.roles.index("a")], args[lay.roles.index("b")]
    out_shape = lay.out_shape(a.shape, b.shape, num_groups)
    bias = check_bias(bias, lay.group_axis, num_groups, out_shape[-1], out_dtype)
    if 0 in (*out_shape, a.shape[-1] if lay.group_axis == 0 else a.shape[lay.span_axis]):
        return _empty_product(out_shape, group_sizes, bias, out_dtype)
    if resolve_backend(backend) == "reference":
        da, db = dequantize(lay, args, group_sizes)
        return reference(da, db, group_sizes, lay.group_axis, lay.align, bias, out_dtype)
    lay = dataclasses.replace(lay, out_dtype=out_dtype, has_bias=bias is not None)
    return call(lay, *args, group_sizes, jnp.zeros((0,), out_dtype) if bias is None else bias)


def _empty_product(out_shape, group_sizes, bias, out_dtype) -> jax.Array:
    """A grouped product with an empty output or contraction, as the kernels define it: zeros, plus each group's
    bias in its rows (group_axis 0). No kernel runs (the handlers take no empty operands)."""
    out = jnp.zeros(out_shape, jnp.float32)
    if bias is not None and out.size:
        group, _, member = grouped_positions(group_sizes, out_shape[0])
        out = jnp.where(member[:, None], bias.astype(jnp.float32)[group], 0.0)
    return out.astype(out_dtype)


def _layout_args(group_sizes, a, b, group_axis, align, mode: modes.ModeSpec):
    """Checks group_sizes and the operand shapes of ``mode``; returns (G, K)."""
    num_groups = check_group_sizes(group_sizes)
    block = mode.block_cols if mode.block else 1
    k = check_layout(a, b, num_groups, group_axis, align, mode.pack, block, mode.label)
    return num_groups, k


def grouped_gemm_fp8(a, b, a_scale_inv, b_scale_inv, group_sizes, bias=None, *, group_axis: int = 0,
                     align: int = GROUP_ALIGN[ScalingMode.FP8_TENSOR], out_dtype=jnp.bfloat16, fast_accum=True,
                     backend=None):
    """Per-tensor FP8 grouped GEMM (layouts in the module docstring).

    Args:
      a, b: FP8 operands (not both E5M2): ``[M, K]`` and ``[G, N, K]`` (group_axis 0), ``[P, Kc]`` and
        ``[Q, Kc]`` (group_axis 1).
      a_scale_inv, b_scale_inv: float32 decode scales, ``[1]`` or one per group ``[G]``.
      group_sizes: int32 ``[G]``.
      bias: ``[G, N]`` (group_axis 0 only; out_dtype or float32) or None.
      group_axis: 0 (rows grouped) or 1 (contraction grouped in aligned spans).
      align: the span alignment of group_axis 1 (16 on CUDA; 1 allowed on CPU).
      out_dtype: float32, bfloat16 or float16.
      fast_accum: Hopper FP8 fast accumulation (ignored on CPU).
      backend: "ffi" or "reference" (default: ``te_jax.ops.backend``'s context).
    """
    mode = modes.FP8_TENSOR
    check_operand_dtypes(a, b, mode.label)
    num_groups, _ = _layout_args(group_sizes, a, b, group_axis, align, mode)
    a_scale_inv = group_value(a_scale_inv, num_groups, "a_scale_inv")
    b_scale_inv = group_value(b_scale_inv, num_groups, "b_scale_inv")
    lay = GroupedLayout(ScalingMode.FP8_TENSOR, "te_jax_grouped_gemm_fp8", ("a", "b", "a_t", "b_t"), group_axis,
                        int(align), attrs=(("fast_accum", check_flag("fast_accum", fast_accum)),))
    return _run(lay, (a, b, a_scale_inv, b_scale_inv), group_sizes, bias, out_dtype, backend)


def grouped_gemm_fp8_block(a, a_s, b, b_s, group_sizes, bias=None, *, a_block_2d=False, b_block_2d=False,
                           group_axis: int = 0, align: int = GROUP_ALIGN[ScalingMode.FP8_BLOCK],
                           out_dtype=jnp.bfloat16, backend=None):
    """Float8 block-scaled grouped GEMM: float32 1/scale per 1x128 block (128x128 when ``*_block_2d``).

    ``a_s`` is ``[M, K/128]`` (2D: ``[M/128, K/128]``), ``b_s`` ``[G, N, K/128]``
    (2D: ``[G, N/128, K/128]``); with group_axis 1 ``[P, Kc/128]`` and
    ``[Q, Kc/128]`` (align a multiple of 128), which the custom call takes
    transposed, K-block-major (``[Kc/128, P]``, ``[Kc/128, Q]``). Other args as
    ``grouped_gemm_fp8``.
    """
    mode = modes.FP8_BLOCK
    check_operand_dtypes(a, b, mode.label)
    _, k = _layout_args(group_sizes, a, b, group_axis, align, mode)
    if a_block_2d and b_block_2d:
        raise ValueError("te_jax: 128x128 x 128x128 block-scaled GEMMs are not supported; quantize one operand "
                         "with 1x128 blocks (Float8BlockQuantizer(block_2d=False))")
    block = mode.block_cols
    for name, x, two_d in (("A", a, a_block_2d), ("B", b, b_block_2d)):
        if two_d and x.shape[-2] % block:
            raise ValueError(f"te_jax: the grouped GEMM's 128x128 blocks need {name}'s rows ({x.shape[-2]}) to be a "
                             f"multiple of {block}; use 1x128 blocks for it (Float8BlockQuantizer(block_2d=False))")
    a_s = check_block_scales(a_s, a, k, block if a_block_2d else 1, block, mode.scale_dtype, "a_s")
    b_s = check_block_scales(b_s, b, k, block if b_block_2d else 1, block, mode.scale_dtype, "b_s")
    if group_axis == 1:  # the custom call takes them K-block-major: each group's span is whole rows
        a_s, b_s = a_s.T, b_s.T
    lay = GroupedLayout(ScalingMode.FP8_BLOCK, "te_jax_grouped_gemm_fp8_block", ("a", "a_s", "b", "b_s"), group_axis,
                        int(align), attrs=(("a_block_2d", bool(a_block_2d)), ("b_block_2d", bool(b_block_2d))),
                        k_block=block)
    return _run(lay, (a, a_s, b, b_s), group_sizes, bias, out_dtype, backend)


def grouped_gemm_mxfp8(a, a_s, b, b_s, group_sizes, bias=None, *, group_axis: int = 0,
                       align: int = GROUP_ALIGN[ScalingMode.MXFP8], out_dtype=jnp.bfloat16, backend=None):
    """MXFP8 grouped GEMM: uint8 E8M0 scales ``a_s [M, K/32]``, ``b_s [G, N, K/32]`` (group_axis 1: ``[P, Kc/32]``,
    ``[Q, Kc/32]``). Other args as ``grouped_gemm_fp8``; on a GPU the emulation runs (``GemmEmulationWarning``)."""
    mode = modes.MXFP8
    check_operand_dtypes(a, b, mode.label)
    _, k = _layout_args(group_sizes, a, b, group_axis, align, mode)
    a_s = check_block_scales(a_s, a, k, 1, mode.block_cols, mode.scale_dtype, "a_s")
    b_s = check_block_scales(b_s, b, k, 1, mode.block_cols, mode.scale_dtype, "b_s")
    lay = GroupedLayout(ScalingMode.MXFP8, "te_jax_grouped_gemm_mxfp8", ("a", "a_s", "b", "b_s"), group_axis,
                        int(align), k_block=mode.block_cols)
    return _run(lay, (a, a_s, b, b_s), group_sizes, bias, out_dtype, backend)


def grouped_gemm_nvfp4(a, a_s, a_amax, b, b_s, b_amax, group_sizes, bias=None, *, group_axis: int = 0,
                       align: int = GROUP_ALIGN[ScalingMode.NVFP4], out_dtype=jnp.bfloat16, backend=None):
    """NVFP4 grouped GEMM: packed E2M1 operands (uint8, K/2 columns), E4M3 scales per 1x16 block, amax ``[1]`` or
    ``[G]``. Each operand decodes as ``e2m1 * s_b * S_dec`` (``te_jax.ops.gemm.gemm_nvfp4``), with its group's
    amax when there is one per group. Other args as ``grouped_gemm_fp8``; on a GPU the emulation runs
    (``GemmEmulationWarning``)."""
    mode = modes.NVFP4
    check_operand_dtypes(a, b, mode.label)
    num_groups, k = _layout_args(group_sizes, a, b, group_axis, align, mode)
    a_s = check_block_scales(a_s, a, k, 1, mode.block_cols, mode.scale_dtype, "a_s")
    b_s = check_block_scales(b_s, b, k, 1, mode.block_cols, mode.scale_dtype, "b_s")
    a_amax = group_value(a_amax, num_groups, "a_amax")
    b_amax = group_value(b_amax, num_groups, "b_amax")
    lay = GroupedLayout(ScalingMode.NVFP4, "te_jax_grouped_gemm_nvfp4", ("a", "a_s", "a_t", "b", "b_s", "b_t"),
                        group_axis, int(align), pack=mode.pack, k_block=mode.block_cols)
    return _run(lay, (a, a_s, a_amax, b, b_s, b_amax), group_sizes, bias, out_dtype, backend)


def _check_bf16_layout(a, b, num_groups: int, group_axis, b_kn: bool) -> None:
    """Checks the bfloat16 operands' shapes for ``group_axis`` (``b_kn``: B ``[G, K, N]``, else ``[G, N, K]``)."""
    if group_axis not in (0, 1) or isinstance(group_axis, bool):
        raise ValueError(f"te_jax: group_axis must be 0 (rows grouped) or 1 (wgrad: rows contracted per group), got "
                         f"{group_axis!r}")
    if group_axis == 1:
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0]:
            raise ValueError(f"te_jax: grouped_gemm_bf16 with group_axis=1 needs A [R, P] and B [R, Q] with one R "
                             f"(the grouped rows); got A {a.shape} and B {b.shape}")
        return
    want = "[G, K, N] (b_kn=True)" if b_kn else "[G, N, K] (b_kn=False)"
    if a.ndim != 2 or b.ndim != 3 or b.shape[1 if b_kn else 2] != a.shape[1]:
        raise ValueError(f"te_jax: grouped_gemm_bf16 with group_axis=0 needs A [M, K] and B {want} with one K; got "
                         f"A {a.shape} and B {b.shape}")
    if b.shape[0] != num_groups:
        raise ValueError(f"te_jax: B has {b.shape[0]} matrices but group_sizes has {num_groups} groups; give one "
                         "size per expert")


def grouped_gemm_bf16(a, b, group_sizes, bias=None, *, group_axis: int = 0, b_kn: bool = True,
                      out_dtype=jnp.bfloat16, backend=None):
    """Unquantized bfloat16 grouped GEMM, float32 accumulation, bfloat16 out (the high-precision MoE path).

    Layouts (group g is the rows ``[off_g, off_g + m_g)``, ``off_g = sum_{h<g} m_h``, cut at the rows; negative
    sizes count as zero):

    * ``group_axis=0``: ``a [M, K]``; ``b [G, K, N]`` with ``b_kn`` (a weight as stored: ``y = x @ W_g``) or
      ``[G, N, K]`` without (the dgrad with the stored weight: ``dx = dy @ W_g^T``); returns ``[M, N]``, zeros
      in the rows past ``sum(m)``. An optional bias ``[G, N]`` is added to group g's rows.
    * ``group_axis=1`` (wgrad): ``a [R, P]``, ``b [R, Q]`` grouped along their rows, unpadded; returns
      ``[G, P, Q]``, ``out[g] = a_g^T @ b_g`` (zeros for an empty group). ``b_kn`` is ignored.

    On CUDA (sm_90) a CUTLASS grouped kernel runs, which needs K and N (group_axis 0), P and Q (group_axis 1) to
    be multiples of 8; other GPUs run XLA's ragged dot (``GemmEmulationWarning``).

    Args:
      a, b: bfloat16 operands as above.
      group_sizes: int32 ``[G]``.
      bias: ``[G, N]`` bfloat16 or float32 (group_axis 0 only), or None.
      group_axis: 0 (rows grouped) or 1 (rows grouped and contracted per group).
      b_kn: group_axis 0: whether ``b`` is ``[G, K, N]`` (True) or ``[G, N, K]`` (False).
      out_dtype: bfloat16 (the only one).
      backend: "ffi" or "reference" (default: ``te_jax.ops.backend``'s context).
    """
    for name, x in (("a", a), ("b", b)):
        if not hasattr(x, "dtype") or jnp.dtype(x.dtype) != jnp.bfloat16:
            raise TypeError(f"te_jax: grouped_gemm_bf16 takes bfloat16 operands, got {name} of dtype "
                            f"{getattr(x, 'dtype', type(x).__name__)}; cast it with .astype(jnp.bfloat16) (or "
                            "quantize both operands and call grouped_gemm)")
    if jnp.dtype(out_dtype) != jnp.bfloat16:
        raise TypeError(f"te_jax: grouped_gemm_bf16 writes bfloat16 only, got out_dtype {out_dtype}; cast the result")
    b_kn = check_flag("b_kn", b_kn)
    num_groups = check_group_sizes(group_sizes)
    _check_bf16_layout(a, b, num_groups, group_axis, b_kn)
    lay = GroupedLayout(None, "te_jax_grouped_gemm_bf16", ("a", "b"), group_axis, 1,
                        attrs=(("b_kn", b_kn and group_axis == 0),))
    return _run(lay, (a, b), group_sizes, bias, out_dtype, backend)


# ---- ScaledTensors -----------------------------------------------------------------------


def _copy(t: ScaledTensor, contract: int, side: str, per_group: bool):
    """(data, scale, amax, colwise) of the copy of ``t`` whose rows run along axis ``contract`` of its matrix.

    ``per_group``: ``t`` was quantized per group (``jax.vmap`` over G), so its arrays carry a leading G axis.
    """
    if len(t.shape) != 2 or t.flatten_axis % 2 != 1:
        raise ValueError(f"te_jax: grouped_gemm: {side} must be a ScaledTensor of a matrix (flatten_axis 1), "
                         f"got shape {t.shape} with flatten_axis {t.flatten_axis}")
    colwise = contract == 0
    if not (t.has_colwise if colwise else t.has_rowwise):
        which, flag = ("columnwise", "colwise") if colwise else ("rowwise", "rowwise")
        raise ValueError(f"te_jax: grouped_gemm: {side} contracts axis {contract}, which needs the {which} copy; "
                         f"quantize it with {flag}=True")
    data, scale = (t.colwise_data, t.colwise_scale_inv) if colwise else (t.data, t.scale_inv)
    if data.ndim != 2 + per_group:
        raise ValueError(f"te_jax: grouped_gemm: {side}'s data must be {'[G, R, C]' if per_group else '[R, C]'}, "
                         f"got {data.shape}")
    amax = t.colwise_amax if colwise and t.scaling_mode.global_amax else t.amax
    if t.scaling_mode.per_tensor:
        scale = scale.reshape(-1)
    if amax is not None:
        amax = amax.reshape(-1)
    return data, scale, amax, colwise


def grouped_gemm(lhs: ScaledTensor, rhs: ScaledTensor, group_sizes: jax.Array, contracting_dims=(1, 0), *,
                 group_axis: int = 0, align: int | None = None, bias=None, out_dtype=jnp.bfloat16,
                 fast_accum: bool | None = None, backend=None) -> jax.Array:
    """The grouped GEMM of two ScaledTensors (one scaling mode), like ``te_jax.ops.gemm.gemm``.

    ``group_axis=0``: ``lhs`` a matrix ``[M, K]`` with rows sorted by group and
    ``rhs`` G matrices quantized per group (``jax.vmap`` of a quantizer over
    ``[G, K, N]``; its arrays carry the leading G axis) contracted over
    ``contracting_dims = (lhs axis, rhs axis)`` (``(1, 0)``: ``x @ W_g``,
    ``(1, 1)``: ``dy @ W_g^T``); returns ``[M, N]``. ``group_axis=1``: both
    are matrices ``[Kc, P]`` and ``[Kc, Q]`` in aligned spans along axis 0
    (their columnwise copies are read; ``contracting_dims`` must be
    ``(0, 0)``); returns ``[G, P, Q]``. ``align`` defaults to the mode's
    ``GROUP_ALIGN``. ``fast_accum`` None: the mode's default (True for
    per-tensor FP8; the block modes have none). Other args as ``grouped_gemm_fp8``.
    """
    if not (isinstance(lhs, ScaledTensor) and isinstance(rhs, ScaledTensor)):
        raise TypeError("te_jax: grouped_gemm multiplies two ScaledTensors; quantize both operands (or call "
                        "te_jax.grouped_dense, which runs unquantized roles in high precision)")
    if lhs.mode is not rhs.mode:
        raise ValueError(f"te_jax: both grouped GEMM operands must use one scaling mode, got {lhs.mode.name} x "
                         f"{rhs.mode.name}")
    lc, rc = (int(d) % 2 for d in contracting_dims)
    if group_axis == 1 and (lc, rc) != (0, 0):
        raise ValueError(f"te_jax: grouped_gemm with group_axis=1 contracts axis 0 of both operands, got "
                         f"contracting_dims {contracting_dims}")
    mode = lhs.mode
    align = GROUP_ALIGN[mode] if align is None else align
    a, a_s, a_amax, _ = _copy(lhs, lc, "lhs", False)
    b, b_s, b_amax, b_col = _copy(rhs, rc, "rhs", group_axis == 0)
    kw = dict(group_axis=group_axis, align=align, out_dtype=out_dtype, backend=backend)
    if mode is ScalingMode.FP8_TENSOR:
        fast_accum = True if fast_accum is None else fast_accum
        return grouped_gemm_fp8(a, b, a_s, b_s, group_sizes, bias, fast_accum=fast_accum, **kw)
    if fast_accum:
        raise ValueError(f"te_jax: fast_accum=True does not apply to {mode.name} GEMMs: they always accumulate in "
                         "float32; pass fast_accum=None or False")
    if mode is ScalingMode.FP8_BLOCK:
        return grouped_gemm_fp8_block(a, a_s, b, b_s, group_sizes, bias, a_block_2d=lhs.block_2d,
                                      b_block_2d=rhs.block_2d, **kw)
    if mode is ScalingMode.MXFP8:
        return grouped_gemm_mxfp8(a, a_s, b, b_s, group_sizes, bias, **kw)
    if (lhs.rht and lc == 0) != (rhs.rht and b_col):
        raise ValueError("te_jax: an NVFP4 columnwise copy with the random Hadamard transform (rht=True) can only be "
                         "multiplied with another one (the transforms cancel); quantize both wgrad operands with "
                         "rht=True, or neither")
    return grouped_gemm_nvfp4(a, a_s, a_amax, b, b_s, b_amax, group_sizes, bias, **kw)
