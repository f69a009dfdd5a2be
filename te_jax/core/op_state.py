"""What every functional op carries in and out besides its arrays: the plan, the state and its statistics.

A functional op returns ``(y, new_state)``. ``new_state`` is the
forward-updated ``state``: the stateful roles' states (delayed scaling), and,
when inspecting, the forward statistics under ``STATS``. The state after
forward and backward is the gradient of ``state``, so the gradient of
``state[STATS]`` (zeros when not given) holds every role's statistics,
forward and backward. Entries the op does not use pass through unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from te_jax.core.stats import STATS_COLLECTION, Sample
from te_jax.ops.sharding import MeshResource

STATS = STATS_COLLECTION  # the key of the statistics in a functional op's state


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static facts of one functional-op call every custom VJP needs (its hashable nondiff argument).

    Attributes:
      mesh_resource: the mesh axes amaxes are reduced over and GEMMs partitioned by.
      state_leaves: ``state_leaves`` of the incoming role states (per GEMM for an MLP).
      stats_leaves: ``te_jax.core.stats.stats_leaves`` of the statistics input (per GEMM for an MLP).
      vary: the varying axes (shard_map) of the op's array arguments, in order.
      inspect: the rows statistics read (None: not inspecting).
    """

    mesh_resource: MeshResource | None
    state_leaves: tuple
    stats_leaves: tuple
    vary: tuple
    inspect: Sample | None

    @property
    def all_vary(self) -> frozenset[str]:
        """Every axis some argument varies over."""
        return frozenset().union(*self.vary)


def given_stats(state: Mapping | None) -> Any:
    """The statistics input in ``state`` (None when it has none)."""
    return None if state is None else state.get(STATS)


def high_precision_state(state: Mapping | None, inspect: Sample | None) -> dict | None:
    """The new state of an unquantized call: ``state`` unchanged, with no forward statistics when inspecting."""
    if state is None and not inspect:
        return None
    return {**dict(state or {}), **({STATS: {}} if inspect else {})}


def updated_state(state: Mapping | None, updates: Mapping, fwd_stats: Any) -> dict:
    """``state`` with ``updates`` (the forward-updated entries) and, when not None, ``fwd_stats`` under ``STATS``."""
    return {**dict(state or {}), **updates, **({} if fwd_stats is None else {STATS: fwd_stats})}


def with_stats(state: Mapping | None, stats: Any) -> dict | None:
    """``state`` with the statistics input ``stats`` under ``STATS`` (``state`` itself when ``stats`` is None)."""
    return state if stats is None else {**dict(state or {}), STATS: stats}


def split_stats(new_state: Mapping | None) -> tuple[dict, Any]:
    """``(the state without STATS, the forward statistics or None)`` of an op's returned state."""
    new_state = dict(new_state or {})
    return new_state, new_state.pop(STATS, None)
