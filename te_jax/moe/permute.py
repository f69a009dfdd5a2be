"""Dropless token permutation: rows grouped by expert, and back.

Each of the ``T`` tokens is assigned to ``k`` experts, ``T * k`` assignments
in all, numbered ``t * k + j`` (token ``t``'s ``j``-th expert). ``permute``
sorts them by expert, stably (so within an expert the tokens keep their
order), and gathers one row of ``x`` per assignment::

    x_sorted, perm = permute(x, routing.expert_ids, num_experts)
    y_sorted = grouped_ffn(x_sorted, perm.group_sizes)   # rows of expert e are contiguous
    y = unpermute(y_sorted, perm, routing.gates)         # [T, H] = sum_j gate_j * y of (t, j)

No token is dropped and every shape is static: ``x_sorted`` always has
``T * k`` rows; only ``group_sizes`` (int32 on the device, zeros allowed)
depends on the routing. With ``align`` > 1 each expert's rows start at a
multiple of ``align`` (``sum_{e'<e} roundup(m_e', align)``, zero rows
between), ``aligned_rows(T * k, E, align)`` rows in all: the layout
``te_jax.grouped_dense(..., group_align=align)`` takes. Both directions, and both gradients, are gathers
(``jax.custom_vjp``): autodiff of a gather is a scatter-add, which on a GPU
costs several times a gather of the same rows; here each gradient row is
gathered through the inverse permutation instead. Gradients flow to ``x``,
to ``y_sorted`` and to the gates.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from te_jax.moe.routing import expert_counts
from te_jax.ops.grouped.layout import materialized, regroup_rows, regroup_sources, span_lengths


class Permutation(NamedTuple):
    """How ``permute`` ordered the assignments, for ``unpermute``.

    Attributes:
      sorted_assignment: int32 ``[R]``: the assignment (``t * k + j``) at
        each row of ``x_sorted``, -1 for the rows between aligned groups
        (``R`` is ``T * k``, or ``aligned_rows(T * k, E, align)``).
      assignment_row: int32 ``[T * k]``: the row of ``x_sorted`` holding each
        assignment (the inverse of ``sorted_assignment``).
      group_sizes: int32 ``[E]``: rows per expert, in expert order.
    """

    sorted_assignment: jax.Array
    assignment_row: jax.Array
    group_sizes: jax.Array


def aligned_rows(assignments: int, num_experts: int, align: int) -> int:
    """Rows of the aligned layout: room for ``assignments`` rows in ``num_experts`` spans rounded to ``align``."""
    return -(-(assignments + num_experts * (align - 1)) // align) * align if align > 1 else assignments


def sort_assignments(expert_ids: jax.Array, num_experts: int, align: int = 1) -> Permutation:
    """The stable by-expert order of the flattened ``expert_ids`` (any shape).

    Args:
      expert_ids: integer ids in ``[0, num_experts)``.
      num_experts: ``E`` (static).
      align: each expert's first row is a multiple of this (static; 1: the rows follow each other).

    Returns:
      A ``Permutation`` over ``expert_ids.size`` assignments.
    """
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"te_jax.moe: align must be a positive int, got {align!r}")
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    packed_row = jnp.argsort(order).astype(jnp.int32)  # each assignment's row when the groups follow each other
    sizes = expert_counts(flat, num_experts)
    if align == 1:
        return Permutation(*materialized(order, packed_row), sizes)
    source, member = regroup_sources(sizes, aligned_rows(flat.size, num_experts, align), 1, align, flat.size)
    # no assignments (an empty batch): every aligned row is padding, and there is nothing to gather from
    sorted_assignment = jnp.where(member, order[source], -1) if flat.size else jnp.full(source.shape, -1, jnp.int32)
    spans = span_lengths(sizes, align)
    assignment_row = (jnp.cumsum(spans) - spans)[flat] + packed_row - (jnp.cumsum(sizes) - sizes)[flat]
    return Permutation(*materialized(sorted_assignment.astype(jnp.int32), assignment_row.astype(jnp.int32)), sizes)


def permute(x: jax.Array, expert_ids: jax.Array, num_experts: int, *,
            align: int = 1) -> tuple[jax.Array, Permutation]:
    """Gathers one row of ``x`` per (token, expert) assignment, grouped by expert.

    Args:
      x: ``[T, H]`` tokens.
      expert_ids: int ``[T, k]``, each token's experts (``Routing.expert_ids``).
      num_experts: ``E`` (static).
      align: each expert's first row is a multiple of this, zero rows between (static).

    Returns:
      ``x_sorted`` ``[T * k, H]`` (expert 0's rows first, then expert 1's, ...;
      ``[aligned_rows(T * k, E, align), H]`` with ``align``) and the ``Permutation``.

    Raises:
      ValueError: at trace time, for ``x`` not 2-D or ``expert_ids`` not
        ``[T, k]``.
    """
    if x.ndim != 2 or expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"te_jax.moe.permute: x must be [tokens, hidden] and expert_ids [tokens, k]; got {x.shape} and "
            f"{expert_ids.shape}"
        )
    perm = sort_assignments(expert_ids, num_experts, align)
    return _gather_rows(expert_ids.shape[1], x, perm.sorted_assignment, perm.assignment_row), perm


def _rows_of(t: jax.Array, sorted_assignment: jax.Array, k: int) -> jax.Array:
    """``t[sorted_assignment // k]``, zero rows where ``sorted_assignment`` is -1 (between aligned groups)."""
    if t.shape[0] == 0:  # no tokens: every row is padding
        return jnp.zeros((sorted_assignment.shape[0], *t.shape[1:]), t.dtype)
    rows = t[jnp.maximum(sorted_assignment, 0) // k]
    if sorted_assignment.shape[0] == t.shape[0] * k:  # packed: every row holds an assignment
        return rows
    return jnp.where((sorted_assignment >= 0)[:, None], rows, jnp.zeros((), rows.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_rows(k: int, x: jax.Array, sorted_assignment: jax.Array, assignment_row: jax.Array) -> jax.Array:
    """``x[sorted_assignment // k]``; its gradient sums each token's ``k`` rows, gathered by ``assignment_row``."""
    return _rows_of(x, sorted_assignment, k)


def _gather_rows_fwd(k, x, sorted_assignment, assignment_row):
    return _gather_rows(k, x, sorted_assignment, assignment_row), assignment_row


def _gather_rows_bwd(k, assignment_row, dx_sorted):
    per_token = dx_sorted[assignment_row].astype(jnp.float32).reshape(assignment_row.shape[0] // k, k,
                                                                      dx_sorted.shape[1])
    return _sum_in_order(per_token).astype(dx_sorted.dtype), None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _sum_in_order(t: jax.Array) -> jax.Array:
    """``t [T, k, ...]`` summed over ``k`` in the order ``j = 0, 1, ...``."""
    total = t[:, 0]
    for j in range(1, t.shape[1]):
        total = total + t[:, j]
    return total


def unpermute(y_sorted: jax.Array, perm: Permutation, gates: jax.Array) -> jax.Array:
    """Combines the experts' rows back per token: ``y[t] = sum_j gates[t, j] * y_sorted[row of (t, j)]``.

    The products and the sum over ``k`` are in float32 (in the order
    ``j = 0, 1, ...``); the result has ``y_sorted``'s dtype.

    Args:
      y_sorted: ``[T * k, H]`` expert outputs in ``permute``'s row order.
      perm: the ``Permutation`` from ``permute``.
      gates: ``[T, k]`` gate weights (``Routing.gates``).

    Returns:
      ``[T, H]``.

    Raises:
      ValueError: at trace time, when the shapes do not match.
    """
    num_tokens, num_experts_per_tok = gates.shape
    rows = perm.sorted_assignment.shape[0]
    if (y_sorted.ndim != 2 or y_sorted.shape[0] != rows or perm.assignment_row.shape[0]
            != num_tokens * num_experts_per_tok):
        raise ValueError(
            f"te_jax.moe.unpermute: y_sorted must be [{rows}, hidden] (permute's rows) for gates of "
            f"[tokens, k] = {list(gates.shape)} and a permutation of {perm.assignment_row.shape[0]} assignments, "
            f"got {y_sorted.shape}"
        )
    return _combine(y_sorted, perm.sorted_assignment, perm.assignment_row, gates)


@jax.custom_vjp
def _combine(y_sorted, sorted_assignment, assignment_row, gates):
    """``unpermute``'s sum; its gradients are gathers (``y_sorted``'s through ``sorted_assignment``)."""
    num_tokens, k = gates.shape
    per_assignment = y_sorted[assignment_row].reshape(num_tokens, k, y_sorted.shape[-1])
    weighted = per_assignment.astype(jnp.float32) * gates.astype(jnp.float32)[..., None]
    return _sum_in_order(weighted).astype(y_sorted.dtype)


def _combine_fwd(y_sorted, sorted_assignment, assignment_row, gates):
    return _combine(y_sorted, sorted_assignment, assignment_row, gates), (y_sorted, sorted_assignment, assignment_row,
                                                                          gates)


def _combine_bwd(res, dy):
    y_sorted, sorted_assignment, assignment_row, gates = res
    num_tokens, k = gates.shape
    gate_of_row = _rows_of(gates.astype(jnp.float32).reshape(-1, 1), sorted_assignment, 1)[:, 0]
    # Rows are gathered in their own dtype and widened after: the gathers move half the bytes.
    dy_rows = _rows_of(dy, sorted_assignment, k).astype(jnp.float32)
    dy_sorted = (dy_rows * gate_of_row[:, None]).astype(y_sorted.dtype)
    per_assignment = y_sorted[assignment_row].reshape(num_tokens, k, y_sorted.shape[-1]).astype(jnp.float32)
    dgates = jnp.sum(per_assignment * dy.astype(jnp.float32)[:, None], axis=-1)
    return dy_sorted, None, None, dgates.astype(gates.dtype)


_combine.defvjp(_combine_fwd, _combine_bwd)


def aligned_layout(x: jax.Array, group_sizes: jax.Array, align: int) -> jax.Array:
    """Rows grouped one after another (``x [R, H]``, ``group_sizes`` summing to at most R) moved to the aligned
    layout ``[aligned_rows(R, G, align), H]`` (``permute``'s with ``align``), zero rows between the groups.

    Its gradient is ``packed_layout`` of the output gradient, and the other way round: both are gathers.
    """
    return _to_aligned(align, x, group_sizes)


def packed_layout(y: jax.Array, group_sizes: jax.Array, align: int, rows: int) -> jax.Array:
    """The inverse of ``aligned_layout``: the groups' rows of ``y`` (aligned) one after another, ``[rows, H]``,
    zero rows past the groups."""
    return _to_packed(align, rows, y, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _to_aligned(align: int, x, group_sizes):
    return regroup_rows(x, group_sizes, aligned_rows(x.shape[0], group_sizes.shape[0], align), 1, align)


def _to_aligned_fwd(align, x, group_sizes):
    return _to_aligned(align, x, group_sizes), (group_sizes, x.shape[0])


def _to_aligned_bwd(align, res, dy):
    group_sizes, rows = res
    return regroup_rows(dy, group_sizes, rows, align, 1), None


_to_aligned.defvjp(_to_aligned_fwd, _to_aligned_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _to_packed(align: int, rows: int, y, group_sizes):
    return regroup_rows(y, group_sizes, rows, align, 1)


def _to_packed_fwd(align, rows, y, group_sizes):
    return _to_packed(align, rows, y, group_sizes), (group_sizes, y.shape[0])


def _to_packed_bwd(align, rows, res, dy):
    group_sizes, aligned = res
    return regroup_rows(dy, group_sizes, aligned, 1, align), None


_to_packed.defvjp(_to_packed_fwd, _to_packed_bwd)
