"""References for the MoE tests: a per-group GEMM loop, a two-GEMM expert FFN and the dense per-token MoE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

HIGHEST = lax.Precision.HIGHEST


def grouped_matmul_reference(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``y[r] = x[r] @ kernel[g]`` for the rows ``r`` of group ``g`` (rows grouped in order); zeros past the sum.

    A loop of ``lax.dot_general`` over the groups, each row's result selected by a mask.
    """
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    rows = jnp.arange(x.shape[0])[:, None]
    y = jnp.zeros((x.shape[0], kernel.shape[-1]), jnp.float32)
    for g in range(kernel.shape[0]):
        product = lax.dot_general(x, kernel[g], (((1,), (0,)), ((), ())), precision=HIGHEST,
                                  preferred_element_type=jnp.float32)
        y = jnp.where((rows >= starts[g]) & (rows < ends[g]), product, y)
    return y.astype(x.dtype)


def grouped_ffn(w_in: jax.Array, w_out: jax.Array):
    """The expert FFN ``gelu(x @ w_in[e]) @ w_out[e]`` as a grouped function ``(rows, group_sizes) -> rows``."""

    def ffn(x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return grouped_matmul_reference(jax.nn.gelu(grouped_matmul_reference(x, w_in, group_sizes)), w_out,
                                        group_sizes)

    return ffn


def dense_moe_reference(x, expert_ids, gates, w_in, w_out) -> jax.Array:
    """``y[t] = sum_j gates[t, j] * FFN_{expert_ids[t, j]}(x[t])``: every expert on every token, then picked."""
    hidden = jax.nn.gelu(jnp.einsum("th,ehf->tef", x, w_in, precision=HIGHEST))
    every = jnp.einsum("tef,efn->ten", hidden, w_out, precision=HIGHEST)
    chosen = jnp.take_along_axis(every, expert_ids[..., None], axis=1)
    return jnp.sum(chosen * gates[..., None], axis=1)


def moe_weights(seed: int, num_experts: int, hidden: int, ffn: int) -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(k1, (num_experts, hidden, ffn)) / np.sqrt(hidden),
            jax.random.normal(k2, (num_experts, ffn, hidden)) / np.sqrt(ffn))


def routing_logits(seed: int, tokens: int, num_experts: int, case: str) -> jax.Array:
    """Router logits for a routing ``case``.

    "random": normal logits; "skew": every token strongly prefers the last expert (top-1 all there);
    "empty": only the first half of the experts can win (the rest get -30).
    """
    logits = jax.random.normal(jax.random.key(seed), (tokens, num_experts))
    if case == "skew":
        return logits.at[:, -1].add(30.0)
    if case == "empty":
        return logits.at[:, num_experts // 2:].add(-30.0)
    assert case == "random", case
    return logits
