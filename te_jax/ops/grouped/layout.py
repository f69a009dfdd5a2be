"""Where a grouped GEMM's groups lie, the checks of its operands, and the static layout of its custom call.

Shared by the public ops (``te_jax.ops.grouped.gemm``), the pure-JAX twins
(``te_jax.ops.grouped.reference``) and the custom call
(``te_jax.ops.grouped.call``). The layouts themselves (``group_axis`` 0 and
1) are described in ``te_jax.ops.grouped.gemm``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax.spec.modes import ScalingMode

__all__ = ["GROUP_ALIGN", "GroupedLayout", "check_bias", "check_group_sizes", "check_layout", "group_value",
           "cut_sizes", "grouped_positions", "in_spans", "materialized", "regroup_rows", "regroup_sources",
           "span_lengths", "valid_group_sizes"]

# The span alignment of group_axis=1 each mode's CUDA kernels need (a block never straddles two groups).
GROUP_ALIGN = {ScalingMode.FP8_TENSOR: 16, ScalingMode.FP8_BLOCK: 128, ScalingMode.MXFP8: 32, ScalingMode.NVFP4: 16}


def materialized(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """``arrays``, each computed once into memory before any of its users runs.

    Row indices and masks derived from group sizes (cumulative sums over the
    groups, searches) feed gathers and selects of ``[rows, H]`` elements. Left
    alone, XLA fuses the index arithmetic into those loops and redoes it for
    every element (a cumulative sum over 64 experts per element made one MoE
    gather ten times slower); behind this barrier each index is computed once
    per row.
    """
    return tuple(lax.optimization_barrier(arrays))


def span_lengths(group_sizes: jax.Array, align: int = 1) -> jax.Array:
    """Each group's span, ``roundup(m_g, align)`` (negative sizes count as zero): int32 ``[G]``."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    return (sizes + (align - 1)) // align * align


def valid_group_sizes(group_sizes: jax.Array, rows: int, align: int = 1) -> jax.Array:
    """The group sizes every grouped path computes with: ``group_sizes`` with the rows past ``rows`` cut.

    Group g starts at ``s_g = sum_{h<g} roundup(max(m_h, 0), align)`` and keeps
    ``clip(rows - s_g, 0, max(m_g, 0))`` rows: a negative size counts as 0,
    a group reaching past ``rows`` keeps the rows up to it and the groups after
    it are empty. Sizes that fit (non-negative, ``sum <= rows``) come back
    unchanged. The sums saturate at ``rows``, so no size (not even int32's
    largest) can wrap them around. int32 ``[G]``.
    """
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, rows)
    spans = (sizes + (align - 1)) // align * align
    ends = lax.associative_scan(lambda a, b: jnp.minimum(a + b, rows), spans)  # sum_{h<=g}, saturated at rows
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return jnp.minimum(sizes, rows - starts)


def cut_sizes(sizes: jax.Array, extent) -> jax.Array:
    """Consecutive ``sizes`` (non-negative) with what lies past ``extent`` cut, as the kernels cut the groups."""
    return jnp.diff(jnp.minimum(jnp.cumsum(sizes), extent), prepend=0)


def grouped_positions(group_sizes: jax.Array, extent: int, align: int = 1):
    """Which group each of ``extent`` rows (spans when ``align`` > 1) belongs to, computed on the device.

    Groups follow each other in ``roundup(m_g, align)``-long spans from 0
    (``align=1``: the rows of group_axis 0). Returns ``(group, index, member)``,
    each ``[extent]``: the group of the span a position lies in (clipped to
    ``G - 1`` past the last span), its index inside that group, and whether it
    holds one of the group's ``m_g`` elements (False in the padding and past
    the last span). Negative sizes count as zero.
    """
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    spans = span_lengths(group_sizes, align)
    ends = jnp.cumsum(spans)
    pos = jnp.arange(extent, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(ends, pos, side="right").astype(jnp.int32), sizes.shape[0] - 1)
    index = pos - (ends[group] - spans[group])
    member = (pos < ends[-1]) & (index < sizes[group])
    return materialized(group, index, member)


def in_spans(group_sizes: jax.Array, extent: int, align: int) -> jax.Array:
    """Whether each of ``extent`` positions lies in a group's ``align``-rounded span, padding included: ``[extent]``.

    group_axis 1 contracts each group over its whole span (``grouped_positions``'s
    ``group`` says which); the positions past the last span belong to no group.
    """
    return jnp.arange(extent, dtype=jnp.int32) < jnp.sum(span_lengths(group_sizes, align))


def regroup_sources(group_sizes: jax.Array, rows: int, source_align: int, target_align: int, extent: int):
    """For each of ``rows`` rows of the layout whose groups start at ``target_align``-rounded rows: its row in the
    ``source_align`` layout (clipped to ``[0, extent)``) and whether it holds a group's row. Align 1: the groups
    follow each other."""
    group, index, member = grouped_positions(group_sizes, rows, target_align)
    spans = span_lengths(group_sizes, source_align)
    return materialized(jnp.clip((jnp.cumsum(spans) - spans)[group] + index, 0, extent - 1), member)


def regroup_rows(t: jax.Array, group_sizes: jax.Array, rows: int, source_align: int, target_align: int) -> jax.Array:
    """``t``'s group rows moved from the ``source_align`` layout to ``rows`` rows of the ``target_align`` one, zero
    rows elsewhere (``regroup_sources``): one gather."""
    if t.shape[0] == 0:  # no row to move
        return jnp.zeros((rows, *t.shape[1:]), t.dtype)
    source, member = regroup_sources(group_sizes, rows, source_align, target_align, t.shape[0])
    return jnp.where(member[:, None], t[source], jnp.zeros((), t.dtype))


# ---- validation ----------------------------------------------------------------------


def check_group_sizes(group_sizes) -> int:
    """Checks that ``group_sizes`` is int32 ``[G]`` with G >= 1; returns G."""
    if not hasattr(group_sizes, "dtype") or jnp.dtype(group_sizes.dtype) != jnp.int32 or group_sizes.ndim != 1:
        got = f"{getattr(group_sizes, 'dtype', type(group_sizes).__name__)}{list(getattr(group_sizes, 'shape', ()))}"
        raise TypeError(f"te_jax: group_sizes must be an int32 array [G] (one row count per group), got {got}; "
                        "pass group_sizes.astype(jnp.int32)")
    if group_sizes.shape[0] < 1:
        raise ValueError("te_jax: group_sizes must have at least one group")
    return group_sizes.shape[0]


def check_layout(a, b, num_groups: int, group_axis, align, pack: int, block: int, label: str) -> int:
    """Checks the operand shapes of ``group_axis``; returns the contraction length K (Kc)."""
    if group_axis not in (0, 1) or isinstance(group_axis, bool):
        raise ValueError(f"te_jax: group_axis must be 0 (rows grouped) or 1 (contraction grouped), got {group_axis!r}")
    if not isinstance(align, (int, np.integer)) or isinstance(align, bool) or align < 1:
        raise ValueError(f"te_jax: align must be a positive int, got {align!r}")
    if group_axis == 0:
        if a.ndim != 2 or b.ndim != 3 or a.shape[-1] != b.shape[-1]:
            raise ValueError(f"te_jax: group_axis=0 needs A [M, K] and B [G, N, K] with one K; got A {a.shape} and "
                             f"B {b.shape}")
        if b.shape[0] != num_groups:
            raise ValueError(f"te_jax: B has {b.shape[0]} matrices but group_sizes has {num_groups} groups; give "
                             "one size per expert")
    elif a.ndim != 2 or b.ndim != 2 or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"te_jax: group_axis=1 needs A [P, Kc] and B [Q, Kc] with one Kc; got A {a.shape} and "
                         f"B {b.shape}")
    k = a.shape[-1] * pack
    if k % block:
        raise ValueError(f"te_jax: {label} grouped GEMM needs the contraction length ({k}) to be a multiple of "
                         f"{block}; pad it")
    if group_axis == 1 and align % block:
        raise ValueError(f"te_jax: {label} grouped GEMM with group_axis=1 needs align ({align}) to be a multiple of "
                         f"its block ({block}): a block must not straddle two groups")
    return k


def group_value(s, num_groups: int, name: str):
    """A per-tensor float32 value: ``[1]`` or one per group ``[G]``."""
    s = jnp.asarray(s, jnp.float32)
    if s.size == 1:
        return s.reshape(1)
    if s.shape != (num_groups,):
        raise ValueError(f"te_jax: {name} must be float32 [1] or one value per group [{num_groups}], got shape "
                         f"{s.shape}")
    return s


def check_bias(bias, group_axis: int, num_groups: int, n: int, out_dtype):
    """Checks a ``[G, N]`` bias (group_axis 0 only); returns it in ``out_dtype`` or float32, or None."""
    if bias is None:
        return None
    if group_axis != 0:
        raise ValueError("te_jax: a grouped GEMM bias applies to group_axis=0 only (add a wgrad bias yourself)")
    bias = jnp.asarray(bias)
    if bias.shape != (num_groups, n):
        raise ValueError(f"te_jax: bias must be [G, N] = [{num_groups}, {n}], got shape {bias.shape}")
    return bias if jnp.dtype(bias.dtype) in (out_dtype, jnp.dtype(jnp.float32)) else bias.astype(jnp.float32)


# ---- the custom call's layout ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupedLayout:
    """Static description of one grouped custom call.

    Roles: "a"/"b" the operands, "a_s"/"b_s" block scales, "a_t"/"b_t" per-tensor
    values (``[1]`` or ``[G]``), "sizes" the group sizes, "bias" (always passed;
    ``[0]`` without one).

    ``mode`` None is the bfloat16 call (``te_jax_grouped_gemm_bf16``, roles
    "a", "b"): its operands keep their natural layouts, ``B [G, K, N]`` (attr
    ``b_kn``) or ``[G, N, K]`` for group_axis 0, and ``A [R, P]``, ``B [R, Q]``
    with the groups' rows stacked (align 1) for group_axis 1.
    """

    mode: ScalingMode | None
    target: str
    roles: tuple[str, ...]
    group_axis: int
    align: int
    attrs: tuple[tuple[str, bool], ...] = ()
    out_dtype: jnp.dtype = jnp.dtype(jnp.float32)
    has_bias: bool = False
    pack: int = 1
    k_block: int = 0

    @property
    def all_roles(self) -> tuple[str, ...]:
        return (*self.roles, "sizes", "bias")

    @property
    def span_axis(self) -> int:
        """The axis of A and B along which group_axis 1's groups lie: the contraction (last) of ``[P, Kc]``, or
        the rows (0) of the bfloat16 call's ``[R, P]``."""
        return 0 if self.mode is None else -1

    def out_shape(self, a_shape, b_shape, num_groups: int) -> tuple[int, ...]:
        """The shape of the call's result for operands of ``a_shape`` and ``b_shape``."""
        if self.group_axis == 0:
            b_kn = self.mode is None and dict(self.attrs)["b_kn"]
            return (a_shape[0], b_shape[-1] if b_kn else b_shape[-2])
        if self.mode is None:
            return (num_groups, a_shape[1], b_shape[1])
        return (num_groups, a_shape[0], b_shape[0])
