"""What the grouped GEMM kernels compute, in pure JAX: the reference twin and the GPU emulation.

* ``reference`` is the "reference" backend of every grouped op: the operands
  dequantized as ``te_jax.spec.reference`` (``dequantize``), a float32
  product per group at HIGHEST precision, the bias in float32, a cast.
* ``emulate`` is what the custom call lowers to on a GPU without a native
  grouped kernel for the mode (``te_jax.ops.grouped.cuda``): the operands
  dequantized to bfloat16, XLA's ragged dot accumulating in float32, the bias,
  a cast.

The bfloat16 call (``GroupedLayout.mode`` None) has nothing to dequantize: its
operands are brought to the layouts above (``B [G, N, K]``; group_axis 1
``A [P, R]``, ``B [Q, R]`` with unpadded spans) and take the same paths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.ops.grouped.layout import GroupedLayout, cut_sizes, grouped_positions, in_spans, span_lengths
from te_jax.spec import reference as ref
from te_jax.spec.modes import ScalingMode

__all__ = ["dequantize", "emulate", "emulation_operands", "reference"]


def _per_group(dequantize_with, values, group_of, axis: int):
    """``dequantize_with(value)`` with a per-tensor value per group: each element takes its group's.

    ``values`` is ``[1]`` (one dequantization) or ``[G]``: then every group's
    dequantization is made and each element along ``axis`` (rows 0, columns
    1) picks its group's (``group_of``), so the values are bit-identical to
    dequantizing with that group's value alone.
    """
    if values.shape[0] == 1:
        return dequantize_with(values)
    every = jax.vmap(lambda v: dequantize_with(v.reshape(1)))(values)  # [G, R, C]
    index = group_of[None, :, None] if axis == 0 else group_of[None, None, :]
    return jnp.take_along_axis(every, index, axis=0)[0]


def _deq_groups(group_sizes, group_axis: int, align: int, a_shape, k: int, deq_a, deq_b, a_values, b_values):
    """Dequantized (A, B) with per-tensor values ``[1]`` or ``[G]``: ``deq_a(value)``, ``deq_b(value)`` -> float32."""
    if group_axis == 0:
        rows_a = grouped_positions(group_sizes, a_shape[0])[0]
        return (_per_group(deq_a, a_values, rows_a, 0),
                deq_b(b_values.reshape(-1, 1) if b_values.shape[0] > 1 else b_values))
    cols = grouped_positions(group_sizes, k, align)[0]
    return _per_group(deq_a, a_values, cols, 1), _per_group(deq_b, b_values, cols, 1)


def _bf16_operands(lay: GroupedLayout, a, b):
    """The bfloat16 call's operands in the quantized modes' layouts, in their own dtype.

    group_axis 0: ``B [G, K, N]`` (``b_kn``) transposed to ``[G, N, K]``; group_axis 1: ``A [R, P]`` and
    ``B [R, Q]`` transposed to ``[P, R]`` and ``[Q, R]`` (the groups along the contraction, align 1).
    """
    if lay.group_axis == 1:
        return a.T, b.T
    return a, (jnp.swapaxes(b, 1, 2) if dict(lay.attrs)["b_kn"] else b)


def dequantize(lay: GroupedLayout, args, group_sizes):
    """Both operands of the custom call's ``args`` (in ``lay.roles`` order) dequantized to float32.

    The block mode's scales of group_axis 1 arrive K-block-major (``[Kc/128, rows]``) and are read back. The
    bfloat16 call's operands are converted and transposed (``_bf16_operands``).
    """
    x = dict(zip(lay.roles, args))
    a, b = x["a"], x["b"]
    if lay.mode is None:
        return tuple(t.astype(jnp.float32) for t in _bf16_operands(lay, a, b))
    k = a.shape[-1] * lay.pack
    if lay.mode is ScalingMode.FP8_TENSOR:
        return _deq_groups(group_sizes, lay.group_axis, lay.align, a.shape, k,
                           lambda v: ref.dequantize_fp8_tensor(a, v), lambda v: ref.dequantize_fp8_tensor(b, v),
                           x["a_t"], x["b_t"])
    if lay.mode is ScalingMode.FP8_BLOCK:
        a_s, b_s = (x["a_s"].T, x["b_s"].T) if lay.group_axis == 1 else (x["a_s"], x["b_s"])
        attrs = dict(lay.attrs)
        return (ref.dequantize_fp8_block(a, a_s, block_2d=attrs["a_block_2d"]),
                ref.dequantize_fp8_block(b, b_s, block_2d=attrs["b_block_2d"]))
    if lay.mode is ScalingMode.MXFP8:
        return ref.dequantize_mxfp8(a, x["a_s"]), ref.dequantize_mxfp8(b, x["b_s"])
    return _deq_groups(group_sizes, lay.group_axis, lay.align, a.shape, k,
                       lambda v: ref.dequantize_nvfp4(a, x["a_s"], v), lambda v: ref.dequantize_nvfp4(b, x["b_s"], v),
                       x["a_t"], x["b_t"])


def reference(da, db, group_sizes, group_axis: int, align: int, bias, out_dtype):
    """Float32 product per group of the dequantized operands ``da``, ``db``, bias in float32, cast."""
    hi = lax.Precision.HIGHEST
    if group_axis == 0:
        group, _, member = grouped_positions(group_sizes, da.shape[0])
        every = jnp.einsum("mk,gnk->gmn", da, db, precision=hi, preferred_element_type=jnp.float32)
        out = jnp.take_along_axis(every, group[None, :, None], axis=0)[0]
        if bias is not None:
            out = out + bias.astype(jnp.float32)[group]
        out = jnp.where(member[:, None], out, 0.0)
    else:
        group = grouped_positions(group_sizes, da.shape[-1], align)[0]
        spans = in_spans(group_sizes, da.shape[-1], align)  # whole spans: padding columns count
        mask = (group[None, :] == jnp.arange(group_sizes.shape[0])[:, None]) & spans[None, :]  # [G, Kc]
        ma = jnp.where(mask[:, None, :], da[None], 0.0)
        mb = jnp.where(mask[:, None, :], db[None], 0.0)
        out = jnp.einsum("gpk,gqk->gpq", ma, mb, precision=hi, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def emulation_operands(lay: GroupedLayout, args):
    """The emulation's bfloat16 operands in the quantized modes' layouts (A ``[M, K]`` or ``[P, Kc]``, B
    ``[G, N, K]`` or ``[Q, Kc]``) and each group's rows (group_axis 0) or whole span (1), cut at M or Kc as the
    kernels cut them."""
    group_sizes = args[len(lay.roles)]
    if lay.mode is None:  # bfloat16 already: no float32 copies
        da, db = _bf16_operands(lay, args[0], args[1])
    else:
        da, db = (t.astype(jnp.bfloat16) for t in dequantize(lay, args[:len(lay.roles)], group_sizes))
    if lay.group_axis == 0:
        return da, db, cut_sizes(span_lengths(group_sizes), da.shape[0])
    return da, db, cut_sizes(span_lengths(group_sizes, lay.align), da.shape[-1])


def emulate(lay: GroupedLayout, *args):
    """The GPU emulation of the custom call (``args`` as the call's: ``lay.roles``, group sizes, bias).

    Operands dequantized to bfloat16, XLA's ragged dot accumulating in float32, bias, cast to ``lay.out_dtype``.
    """
    group_sizes, bias = args[len(lay.roles)], args[-1]
    da, db, sizes = emulation_operands(lay, args)
    if lay.group_axis == 0:
        out = lax.ragged_dot(da, jnp.swapaxes(db, 1, 2), sizes, preferred_element_type=jnp.float32)
        group, _, member = grouped_positions(group_sizes, da.shape[0])
        if lay.has_bias:
            out = out + bias.astype(jnp.float32)[group]
        out = jnp.where(member[:, None], out, 0.0)
    else:
        numbers = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [1]), ([], [])),
                                                lhs_ragged_dimensions=[1], rhs_group_dimensions=[])
        out = lax.ragged_dot_general(da, db, sizes, numbers, preferred_element_type=jnp.float32)
    return out.astype(lay.out_dtype)
