"""Expert parallelism inside ``shard_map``: rows to the devices that own their experts, and back.

The experts are split over one mesh axis (``axis_name``, size ``P``): device
``d`` of that axis owns experts ``[d * E / P, (d + 1) * E / P)``. The tokens
are split over the data axes (which may include ``axis_name``). Each device
routes and ``permute``s its own tokens; its rows are then grouped by
expert, hence by destination device, and ``dispatch`` sends them::

    x_sorted, perm = permute(x, expert_ids, num_experts)            # local tokens
    x_local, local_sizes, exchange = dispatch(x_sorted, perm.group_sizes, "ep")
    y_local = grouped_ffn(x_local, local_sizes)                     # local experts' weights
    y = unpermute(combine(y_local, exchange, "ep"), perm, gates)

``apply_experts`` is that sequence (or, without ``axis_name``, the one-device
one).

The exchange is ``jax.lax.all_to_all`` with a fixed number of row slots,
``capacity``, per (sender, receiver) pair: XLA's CPU backend has no
``ragged-all-to-all``. The default capacity is the sender's whole row count
(``T_local * k``), so no row is ever dropped even when every token picks the
same device's experts; the price is receive buffers of ``P * capacity``
rows. A smaller ``capacity`` drops the rows past it (those of the highest
experts within each destination, latest tokens first); their expert output
counts as zero and ``ExpertExchange.dropped`` counts them.

Three all-to-alls run forward (the per-expert row counts, the rows, the
results back) and two more backward (the transposes of the row exchanges).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.moe.permute import permute, unpermute

ExpertFn = Callable[[jax.Array, jax.Array], jax.Array]


class ExpertExchange(NamedTuple):
    """What ``combine`` needs to send the results back, from ``dispatch``.

    With ``P`` devices on the expert axis, ``C`` slots per pair and ``M``
    rows sent by this device:

    Attributes:
      row_slot: int32 ``[M]``: the send slot (``destination * C + slot``) of
        each of this device's sorted rows.
      row_sent: bool ``[M]``: whether the row fitted in its capacity.
      local_slot: int32 ``[P * C]``: the receive slot (``source * C + slot``)
        at each row of the expert-sorted local rows.
      local_row: int32 ``[P * C]``: the local row of each receive slot (the
        inverse of ``local_slot``).
      dropped: int32 scalar: this device's rows past the capacity.
    """

    row_slot: jax.Array
    row_sent: jax.Array
    local_slot: jax.Array
    local_row: jax.Array
    dropped: jax.Array


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def dispatch(
    x_sorted: jax.Array, group_sizes: jax.Array, axis_name: str, *, capacity: int | None = None
) -> tuple[jax.Array, jax.Array, ExpertExchange]:
    """Sends each expert-sorted row to the device owning its expert; call inside ``shard_map``.

    Args:
      x_sorted: ``[M, H]`` this device's rows grouped by expert (``permute``'s
        output; ``M = T_local * k``).
      group_sizes: int32 ``[E]``, this device's rows per expert (all ``E``
        experts, ``E`` divisible by the size of ``axis_name``).
      axis_name: the mesh axis the experts are split over.
      capacity: row slots per (sender, receiver) pair (static); None for
        ``M``, which never drops a row.

    Returns:
      ``x_local`` ``[P * C, H]``: the received rows grouped by local expert
      (expert ``d * E / P`` first), each expert's rows ordered by source
      device then by the source's order, then zero rows;
      ``local_group_sizes`` int32 ``[E / P]``; and the ``ExpertExchange`` for
      ``combine``.

    Raises:
      ValueError: at trace time, for shapes that do not fit, ``E`` not
        divisible by the axis size, or a capacity below 1.
    """
    num_rows = x_sorted.shape[0]
    num_experts = group_sizes.shape[0] if group_sizes.ndim == 1 else -1
    num_devices = lax.axis_size(axis_name)
    if x_sorted.ndim != 2 or num_experts < 1:
        raise ValueError(
            f"te_jax.moe.dispatch: x_sorted must be [rows, hidden] and group_sizes [experts]; got {x_sorted.shape} "
            f"and {group_sizes.shape}"
        )
    if num_experts % num_devices:
        raise ValueError(
            f"te_jax.moe.dispatch: {num_experts} experts cannot be split evenly over the {num_devices} devices of "
            f"mesh axis {axis_name!r}; use a number of experts divisible by {num_devices}"
        )
    if capacity is None:
        capacity = num_rows
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"te_jax.moe.dispatch: capacity must be a positive int or None, got {capacity!r}")
    local_experts = num_experts // num_devices

    # Per destination: where its rows start in x_sorted, and how many rows each of its experts gets within
    # the capacity (the first `capacity` rows of the destination are sent).
    per_expert = group_sizes.astype(jnp.int32).reshape(num_devices, local_experts)
    dest_count = jnp.sum(per_expert, axis=1)
    dest_start = _exclusive_cumsum(dest_count)
    cum = jnp.cumsum(per_expert, axis=1)
    sent_per_expert = jnp.minimum(cum, capacity) - jnp.minimum(cum - per_expert, capacity)

    slot = jnp.arange(capacity, dtype=jnp.int32)
    send_row = dest_start[:, None] + slot[None, :]
    send_valid = slot[None, :] < jnp.minimum(dest_count, capacity)[:, None]
    x_send = jnp.where(send_valid[..., None], x_sorted[jnp.clip(send_row, 0, num_rows - 1)], 0)

    received = lax.all_to_all(x_send, axis_name, 0, 0, tiled=True).reshape(num_devices * capacity, -1)
    recv_per_expert = lax.all_to_all(sent_per_expert, axis_name, 0, 0, tiled=True)

    # Local expert of each receive slot (local_experts for an empty slot), then a stable sort by it.
    recv_cum = jnp.cumsum(recv_per_expert, axis=1)
    slot_expert = jax.vmap(lambda c: jnp.searchsorted(c, slot, side="right"))(recv_cum).reshape(-1)
    local_slot = jnp.argsort(slot_expert, stable=True).astype(jnp.int32)
    local_row = jnp.argsort(local_slot).astype(jnp.int32)

    row = jnp.arange(num_rows, dtype=jnp.int32)
    row_dest = jnp.searchsorted(jnp.cumsum(dest_count), row, side="right").astype(jnp.int32)
    row_dest = jnp.minimum(row_dest, num_devices - 1)
    row_offset = row - dest_start[row_dest]
    exchange = ExpertExchange(
        row_slot=row_dest * capacity + jnp.minimum(row_offset, capacity - 1),
        row_sent=row_offset < capacity,
        local_slot=local_slot,
        local_row=local_row,
        dropped=num_rows - jnp.sum(jnp.minimum(dest_count, capacity)),
    )
    return received[local_slot], jnp.sum(recv_per_expert, axis=0), exchange


def combine(y_local: jax.Array, exchange: ExpertExchange, axis_name: str) -> jax.Array:
    """Sends the local experts' results back to the rows' devices; the reverse of ``dispatch``.

    Args:
      y_local: ``[P * C, N]`` results in ``dispatch``'s ``x_local`` row order
        (rows past the local group sizes are ignored).
      exchange: the ``ExpertExchange`` from ``dispatch``.
      axis_name: the same mesh axis.

    Returns:
      ``[M, N]`` in this device's ``x_sorted`` row order; dropped rows are 0.
    """
    num_devices = lax.axis_size(axis_name)
    slots = y_local[exchange.local_row].reshape(num_devices, -1, y_local.shape[-1])
    returned = lax.all_to_all(slots, axis_name, 0, 0, tiled=True).reshape(-1, y_local.shape[-1])
    return jnp.where(exchange.row_sent[:, None], returned[exchange.row_slot], 0)


def apply_experts(
    x: jax.Array,
    expert_ids: jax.Array,
    gates: jax.Array,
    expert_fn: ExpertFn,
    *,
    num_experts: int,
    axis_name: str | None = None,
    capacity: int | None = None,
) -> jax.Array:
    """``y[t] = sum_j gates[t, j] * FFN_{expert_ids[t, j]}(x[t])``, dropless, with or without expert parallelism.

    Args:
      x: ``[T, H]`` tokens (this device's, inside ``shard_map``).
      expert_ids: int ``[T, k]`` (``Routing.expert_ids``).
      gates: ``[T, k]`` (``Routing.gates``).
      expert_fn: ``(rows [R, H], group_sizes int32 [G]) -> [R, N]``, the
        grouped FFN: the first ``group_sizes[0]`` rows go through expert 0
        (of those it holds), the next ``group_sizes[1]`` through expert 1, ...
        Rows past ``sum(group_sizes)`` may hold anything; their results are
        ignored. Without ``axis_name`` ``G = E``; with it ``G = E / P`` and
        the function applies this device's experts.
      num_experts: ``E``, all experts (static).
      axis_name: the mesh axis the experts are split over, inside
        ``shard_map``; None on one device.
      capacity: ``dispatch``'s capacity (only with ``axis_name``).

    Returns:
      ``[T, N]`` in the dtype of ``expert_fn``'s result.

    Raises:
      ValueError: at trace time, for a capacity given without ``axis_name``.
    """
    x_sorted, perm = permute(x, expert_ids, num_experts)
    if axis_name is None:
        if capacity is not None:
            raise ValueError("te_jax.moe.apply_experts: capacity needs axis_name (one device never drops rows)")
        return unpermute(expert_fn(x_sorted, perm.group_sizes), perm, gates)
    x_local, local_group_sizes, exchange = dispatch(x_sorted, perm.group_sizes, axis_name, capacity=capacity)
    y_sorted = combine(expert_fn(x_local, local_group_sizes), exchange, axis_name)
    return unpermute(y_sorted, perm, gates)
