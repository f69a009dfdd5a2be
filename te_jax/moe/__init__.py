"""Mixture-of-experts building blocks: routing, dropless permutation and expert-parallel exchange.

Pure functions, jit-compatible with static shapes; see docs/moe.md.
"""

from te_jax.moe.dispatch import ExpertExchange, apply_experts, combine, dispatch
from te_jax.moe.permute import (Permutation, aligned_layout, aligned_rows, packed_layout, permute, sort_assignments,
                                 unpermute)
from te_jax.moe.routing import (
    SCORE_FUNCTIONS,
    Routing,
    expert_counts,
    load_balancing_loss,
    route,
    update_expert_bias,
)

__all__ = [
    "SCORE_FUNCTIONS", "ExpertExchange", "Permutation", "Routing", "aligned_layout", "aligned_rows", "apply_experts",
    "combine", "dispatch", "packed_layout",
    "expert_counts", "load_balancing_loss", "permute", "route", "sort_assignments", "unpermute",
    "update_expert_bias",
]
