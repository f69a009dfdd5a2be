"""The statistics of one quantized tensor, computed inside the traced step from the copy a GEMM reads.

Every statistic is a float32 scalar, computed from the high-precision tensor
``x`` and the ScaledTensor its quantizer already made (nothing is quantized
twice; the represented values come from ``dequantize``). Fractions count the
nonzero elements of ``x`` (zeros can neither underflow nor saturate); a tensor
without any gives 0.

* ``amax``: ``max |x|``.
* ``scale``: the encode scale (``1 / decode scale``: x times it lands on the
  format's grid). Per-tensor modes: the tensor's scale. Block modes: the
  geometric mean over the blocks that hold a nonzero value.
* ``underflow``: fraction of the nonzero elements whose represented value is 0.
* ``saturation``: fraction of the nonzero elements whose code is the format's
  largest magnitude (448 E4M3, 57344 E5M2, 6 E2M1) *and* whose ``|x|`` exceeds
  the represented value by more than a relative ``SATURATION_MARGIN``: values
  clipped because they lie beyond the largest value their block can hold (the
  margin absorbs float32 rounding of scale and inverse, so the element that
  current scaling maps exactly onto the format's max does not count).
* ``rel_error``: ``||x - dequant(quant(x))||_2 / ||x||_2`` over the tensor (0 when x is 0).
* ``scale_log2_range``: ``log2(max / min)`` of the decode scales of the
  blocks holding a nonzero value (0 for per-tensor modes: one scale).
* ``scale_log2_std``: the standard deviation of those blocks' ``log2`` decode scales.
* ``skipped_update``: 1 when this step's delayed-scaling update of the
  tensor's state was skipped (its amax was NaN or Inf, or
  ``scaling_factor_compute_algo`` returned a scale that is not finite and
  positive: ``te_jax.quantize.delayed``), else 0 (and 0 for a quantizer
  without state). Uses of a layer in one step merge by max; summed over steps
  (``te_jax.inspect.mean_over``) it counts the skipped steps.

Blocks whose decode scale is 0 or not finite (an NVFP4 block scale that
underflowed in E4M3) are left out of the scale statistics; ``underflow`` shows them.

Sampling (``Sample(every=k)``, k > 1) reads every k-th row of the rowwise
``[M, N]`` matrix (rows 0, k, 2k, ...): a row is whole blocks of every 1D
layout, so each statistic is the exact statistic of those rows. The stride
used is the largest divisor of the rows per device (M, or M over the devices
of an Explicit mesh axis) not above k, so the sample stays on each device.
``amax`` stays the whole tensor's when the quantizer measured it (per-tensor
modes and NVFP4 carry it in the ScaledTensor); otherwise it is the sampled
rows' maximum, and a NaN or Inf in a row not read is not seen. Column-wise
copies (weights) and 2D-blocked tensors are always read whole: they are
weights, small next to activations and gradients.
"""

from __future__ import annotations

import functools

from collections.abc import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from te_jax.ops.dequantize import dequantize, dequantize_colwise
from te_jax.ops.quantize import pad_to_blocks
from te_jax.spec import numerics as nm
from te_jax.spec.modes import ScaledTensor, ScalingMode
from te_jax.recipe.autocast import Sample, as_sample  # noqa: F401  (re-exported)
from te_jax.ops.sharding import dim_shards, explicit_axes, match_cotangent, varying_axes

STATS_COLLECTION = "fp8_stats"
# What a tensor and its quantization give; then what its state update gives.
TENSOR_STAT_NAMES = ("amax", "scale", "underflow", "saturation", "rel_error", "scale_log2_range", "scale_log2_std")
STAT_NAMES = (*TENSOR_STAT_NAMES, "skipped_update")
COUNTED = ("skipped_update",)  # statistics summed, not averaged, over steps
SATURATION_MARGIN = 2.0**-16
COPIES = ("rowwise", "colwise")
_BLOCK = {ScalingMode.MXFP8: 32, ScalingMode.FP8_BLOCK: 128, ScalingMode.NVFP4: 16}

Stats = dict[str, jax.Array]


def zeros(roles: Iterable[str]) -> dict[str, Stats]:
    """``{role: {stat: f32[] zero}}``: a functional op's statistics input.

    A functional op takes it as ``state["fp8_stats"]``; its gradient carries the statistics.
    """
    return {str(r): {n: jnp.zeros((), jnp.float32) for n in STAT_NAMES} for r in roles}


def stats_input(roles: Iterable[str], stats=None) -> dict[str, Stats]:
    """A core's statistics input: ``stats`` as given (``{role: {stat: f32[]}}``), or zeros for ``roles``."""
    if stats is None:
        return zeros(roles)
    return {str(r): dict(v) for r, v in stats.items()}


def stats_leaves(stats: Mapping[str, Mapping[str, jax.Array]] | None) -> tuple:
    """Static ``((role, stat, dtype, varying axes), ...)`` of a statistics input (() for None)."""
    stats = stats or {}
    return tuple((r, n, v.dtype, varying_axes(v)) for r in sorted(stats) for n, v in sorted(stats[r].items()))


def stats_cotangent(leaves: tuple, stats: Mapping | None, all_vary) -> dict[str, Stats] | None:
    """The statistics as the cotangent of the statistics input with ``leaves`` (None when not inspecting).

    Each leaf takes the input leaf's dtype (a max-merging one under
    ``te_jax.train.value_and_grad``) and, in shard_map, its varying axes,
    reduced by max. Leaves no quantization produced (a role in high precision) get 0.
    """
    if stats is None:
        return None
    out: dict[str, Stats] = {}
    for role, name, dtype, vary in leaves:
        g = stats.get(role, {}).get(name, jnp.zeros((), jnp.float32))
        out.setdefault(role, {})[name] = lax.convert_element_type(match_cotangent(g, all_vary, vary, "max"), dtype)
    return out


def primary_copy(role: str) -> str:
    """The copy the statistics describe: the forward GEMM's operand ("colwise" for weights), else rowwise."""
    return "colwise" if str(role) == "linear_weight" else "rowwise"


def format_max(t: ScaledTensor) -> float:
    """The largest magnitude of ``t``'s element format."""
    return nm.E2M1_MAX if t.mode is ScalingMode.NVFP4 else nm.fp8_max(t.qdtype)


def _copy(t: ScaledTensor, copy: str):
    """``(codes, decode scales)`` of one copy: codes as float32 in format units, one decode scale per block."""
    if copy == "rowwise":
        data, scales, amax = t.data, t.scale_inv, t.amax
    else:
        data, scales = t.colwise_data, t.colwise_scale_inv
        amax = t.colwise_amax if t.mode is ScalingMode.NVFP4 else t.amax
    if data is None:
        raise ValueError(f"te_jax.inspect: the ScaledTensor has no {copy} copy")
    if t.mode is ScalingMode.NVFP4:
        codes = nm.e2m1_to_float(nm.unpack_nibbles(data))
        decode = scales.astype(jnp.float32) * nm.reciprocal(nm.nvfp4_global_encode_scale(amax))
        if t.block_2d:  # stored per row, repeated over the block's 16 rows
            decode = decode[::_BLOCK[t.mode]]
    elif t.mode is ScalingMode.MXFP8:
        codes, decode = data.astype(jnp.float32), nm.e8m0_to_float(scales)
    else:
        codes, decode = data.astype(jnp.float32), scales.astype(jnp.float32)
    return codes, decode


_SUM, _MAX, _MIN = lax.add, lax.max, lax.min


def _variadic(terms: list[tuple[jax.Array, jax.Array, object]], axes: tuple[int, ...]) -> list[jax.Array]:
    """One variadic reduction of ``(operand, init, combine op)`` terms (equal shapes) over ``axes``.

    XLA emits one kernel for it, reading every operand once; separate reductions are a kernel each,
    and the statistics of a step cover a few hundred tensors, so kernel count is most of their cost.
    """
    operands, inits, ops = zip(*terms)

    def combine(a, b):
        return tuple(op(u, v) for op, u, v in zip(ops, a, b))

    return list(lax.reduce(operands, inits, combine, axes))


def _group_partials(xm: jax.Array, values: jax.Array, codes: jax.Array, fmt_max: float, group: int) -> list:
    """Per group of ``group`` consecutive elements of a row: ``max |x|``, then the counts of nonzero,
    underflowed and saturated elements (int32), ``sum (x - value)^2`` and ``sum x^2``.

    One variadic reduction, so XLA reads ``x`` and the quantized copy once for every statistic.
    """
    m, n = xm.shape
    xg, vg, cg = (a.reshape(m, n // group, group) for a in (xm, values, codes))
    ax = jnp.abs(xg)
    nonzero = xg != 0
    beyond = ax > jnp.abs(vg) * jnp.float32(1 + SATURATION_MARGIN)
    count = lambda b: b.astype(jnp.int32)  # noqa: E731  (exact where a float32 count would not be)
    zero_f, zero_i = jnp.float32(0), jnp.int32(0)
    return _variadic([(ax, zero_f, _MAX), (count(nonzero), zero_i, _SUM), (count(nonzero & (vg == 0)), zero_i, _SUM),
                      (count(nonzero & beyond & (jnp.abs(cg) == fmt_max)), zero_i, _SUM),
                      (jnp.square(xg - vg), zero_f, _SUM), (jnp.square(xg), zero_f, _SUM)], (2,))


def _block_amax(group_amax: jax.Array, t: ScaledTensor) -> jax.Array:
    """``max |x|`` per block, shaped like one copy's decode scales, from the per-row-group maxima."""
    if t.block_2d:
        b = _BLOCK[t.mode]
        group_amax = pad_to_blocks(group_amax, b, 1)  # a partial last row of blocks
        m, nb = group_amax.shape
        return jnp.max(group_amax.reshape(m // b, b, nb), axis=1)
    return group_amax


def _ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den``, 0 where ``den`` is 0 (NaN and Inf go through: a tensor holding NaN has a NaN error)."""
    return jnp.where(den == 0, 0, num / jnp.where(den == 0, 1, den)).astype(jnp.float32)


def _scale_terms(decode: jax.Array, block_amax: jax.Array) -> tuple[jax.Array, list]:
    """``(log2 of the decode scales, reduction terms)``: the count, sum, max and min of log2 over the
    blocks that hold a nonzero value and have a positive finite scale."""
    ok = (decode > 0) & nm.is_finite(decode) & (block_amax > 0)
    log2 = jnp.log2(jnp.where(ok, decode, 1))
    return jnp.where(ok, log2, jnp.nan), [
        (ok.astype(jnp.int32), jnp.int32(0), _SUM), (jnp.where(ok, log2, 0), jnp.float32(0), _SUM),
        (jnp.where(ok, log2, -jnp.inf), jnp.float32(-jnp.inf), _MAX),
        (jnp.where(ok, log2, jnp.inf), jnp.float32(jnp.inf), _MIN)]


def _scale_stats(log2: jax.Array, n_ok, total, top, bottom) -> Stats:
    """``scale``, ``scale_log2_range`` and ``scale_log2_std`` from the reduced log2 terms (the deviation
    takes a second pass over ``log2``, NaN where a block is left out: exact where one pass would cancel)."""
    n = n_ok.astype(jnp.float32)
    mean = _ratio(total, n)
    var = _ratio(jnp.sum(jnp.where(jnp.isnan(log2), 0, jnp.square(log2 - mean))), n)
    return {"scale": jnp.where(n > 0, jnp.exp2(-mean), 0).astype(jnp.float32),
            "scale_log2_range": jnp.where(n > 0, top - bottom, 0).astype(jnp.float32),
            "scale_log2_std": jnp.sqrt(var)}


def _sampled_rows(t: ScaledTensor, copy: str, sample: Sample | None, rows_of: jax.Array) -> int:
    """The row stride the statistics of ``t``'s ``copy`` read with (1: every row).

    The largest divisor of the rows per device (``rows_of``'s first dimension, as its sharding splits
    it) that is at most ``sample.every``: then rows 0, k, 2k, ... of the whole tensor are rows 0, k,
    2k, ... of every device's block, and the sample moves no data between devices (a typed Explicit
    sharding would refuse a slice that did).
    """
    if sample is None or sample.every == 1 or copy != "rowwise" or t.block_2d:
        return 1
    rows = rows_of.shape[0] // dim_shards(rows_of, 0)
    return max(d for d in range(1, min(sample.every, rows) + 1) if rows % d == 0)


def tensor_stats(x: jax.Array | Callable[[slice], jax.Array], t: ScaledTensor, copy: str = "rowwise",
                 sample: Sample | None = None) -> Stats:
    """The statistics (``STAT_NAMES``) of ``t``'s ``copy``, the quantization of ``x``.

    Args:
      x: the high-precision tensor ``t`` quantizes, in ``t.shape``; or a function
        ``rows -> x.reshape(t.matrix_shape)[rows]`` that computes just the rows
        asked for (a fused kernel's output recomputed by its pure-JAX twin:
        with sampling, only the sampled rows are recomputed).
      t: its ScaledTensor.
      copy: "rowwise" (the ``[M, N]`` matrix) or "colwise" (``[N, M]``,
        compared in the Hadamard domain when ``t.rht``).
      sample: which rows to read (None: all; see the module docstring).

    ``skipped_update`` is 0 here (a tensor alone has no state update); the
    functional ops set it for a stateful quantizer (``with_skipped_update``).
    """
    return {**_stats_of(x, t, copy, sample), "skipped_update": jnp.zeros((), jnp.float32)}


def with_skipped_update(stats: Stats, skipped: jax.Array) -> Stats:
    """``stats`` with ``skipped_update`` the max of ``skipped`` (1 where the quantizer's state update skipped this
    step, ``te_jax.quantize.delayed.update_skipped``)."""
    return {**stats, "skipped_update": jnp.max(jnp.asarray(skipped, jnp.float32))}


def _stats_of(x: jax.Array | Callable[[slice], jax.Array], t: ScaledTensor, copy: str,
              sample: Sample | None) -> Stats:
    """``tensor_stats`` but ``skipped_update``."""
    if copy not in COPIES:
        raise ValueError(f"te_jax.inspect: copy must be one of {COPIES}, got {copy!r}")
    whole = x(slice(None)) if callable(x) else x
    # The rows' sharding comes from the high-precision tensor's type: a custom call's outputs (t) carry
    # no Explicit axes. When only sampled rows are recomputed below, the whole recompute traced here
    # is dead code that XLA drops.
    explicit = explicit_axes(whole)
    every = _sampled_rows(t, copy, sample, whole.reshape(t.matrix_shape))
    if callable(x) and every > 1 and not explicit:
        # Only the rows the statistics read are recomputed (under Explicit axes the strided slice of a
        # typed split dimension is left to the Auto-axes reduction below).
        return _tensor_stats(x(slice(None, None, every)), t, copy, every, presampled=True)
    x = whole
    if explicit:
        # Typed (Explicit) shardings give the variadic reductions no rule but gathering their operands
        # whole; as Auto axes, XLA partitions them like any reduction (per device, then the totals).
        return jax.sharding.auto_axes(functools.partial(_tensor_stats, copy=copy, every=every), axes=explicit,
                                      out_sharding=P())(x, t)
    return _tensor_stats(x, t, copy, every)


def _tensor_stats(x: jax.Array, t: ScaledTensor, copy: str, every: int, presampled: bool = False) -> Stats:
    """The statistics of ``x`` (``t.matrix_shape``, or its rows 0, every, ... when ``presampled``)."""
    xm = x.astype(jnp.float32).reshape((-1, t.matrix_shape[1]) if presampled else t.matrix_shape)
    # The pure-JAX dequantize (bit-identical to the custom call): XLA fuses it into the reductions
    # below, where the custom call would write and re-read a float32 copy of the tensor.
    # A partial block is compared with its zero padding (the copy's last axis), which adds to no statistic.
    block = _BLOCK.get(t.mode, 1)
    if copy == "colwise":
        xm = pad_to_blocks(xm.T, 1, block)
        values = pad_to_blocks(dequantize_colwise(t, jnp.float32, backend="reference"), 1, block)
        if t.rht:
            xm = nm.rht16(xm)
    else:
        xm = pad_to_blocks(xm, 1, block)
        values = pad_to_blocks(dequantize(t, jnp.float32, backend="reference").reshape(t.matrix_shape), 1, block)
    codes, decode = _copy(t, copy)
    if every > 1:  # strided row slices; XLA fuses them into the reduction's reads
        xm = xm if presampled else xm[::every]
        values, codes = values[::every], codes[::every]
        decode = decode if decode.size == 1 else decode[::every]
    per_tensor = t.mode is ScalingMode.FP8_TENSOR
    group = xm.shape[1] if per_tensor else _BLOCK[t.mode]  # per-tensor: one group per row
    partials = _group_partials(xm, values, codes, format_max(t), group)
    # The totals (and, when the decode scales line up with the groups, their log2 terms) in one more
    # reduction over all groups.
    zero_f, zero_i = jnp.float32(0), jnp.int32(0)
    terms = [(partials[0], zero_f, _MAX), *((p, zero_i, _SUM) for p in partials[1:4]),
             *((p, zero_f, _SUM) for p in partials[4:])]
    log2, scale_terms = None, []
    if not per_tensor:
        block_amax = _block_amax(partials[0], t)
        log2, scale_terms = _scale_terms(decode, block_amax)
    lined_up = not per_tensor and block_amax.shape == partials[0].shape  # 1D blocks: one block per group
    totals = _variadic(terms + scale_terms if lined_up else terms, (0, 1))
    if scale_terms and not lined_up:  # 2D blocks: their own (small) reduction
        totals += _variadic(scale_terms, (0, 1))
    amax, n_nonzero, underflow, saturated = totals[0], *(v.astype(jnp.float32) for v in totals[1:4])
    err, norm = jnp.sqrt(totals[4]), jnp.sqrt(totals[5])
    if every > 1 and t.amax is not None and t.mode in (ScalingMode.FP8_TENSOR, ScalingMode.NVFP4):
        amax = jnp.asarray(t.amax, jnp.float32).reshape(())  # the quantizer's amax covers every row
    out = {"amax": amax, "underflow": _ratio(underflow, n_nonzero),
           "saturation": _ratio(saturated, n_nonzero), "rel_error": _ratio(err, norm)}
    if per_tensor:  # one scale, no spread (not computed: log2's rounding may differ between fusions)
        zero = jnp.zeros((), jnp.float32)
        out.update(scale=nm.reciprocal(decode.reshape(())), scale_log2_range=zero, scale_log2_std=zero)
    else:
        out.update(_scale_stats(log2, *totals[6:]))
    return {n: out[n].astype(jnp.float32) for n in TENSOR_STAT_NAMES}
