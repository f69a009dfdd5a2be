"""The MoE router: top-k expert choice, gate weights and the load-balancing loss.

``route`` turns router logits ``[T, E]`` (float32, unquantized) into each
token's ``k`` experts and gate weights, the per-expert assignment counts and
a Switch-style auxiliary loss. Two score functions:

* ``"softmax"`` (Mixtral): probabilities are the softmax over the experts,
  the top ``k`` are chosen, and their gates are those probabilities,
  renormalised over the chosen ``k`` when ``normalize_gates``.
* ``"sigmoid"`` (DeepSeek-V3): scores are ``sigmoid(logits)``; the top ``k``
  are chosen by ``scores + expert_bias`` (auxiliary-loss-free balancing: the
  bias steers the choice only), and the gates are the unbiased scores,
  normalised over the chosen ``k`` when ``normalize_gates``.

``expert_bias`` is accepted with either score function; ``update_expert_bias``
is the balancing step that moves it toward equal loads.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

SCORE_FUNCTIONS = ("softmax", "sigmoid")
AxisNames = str | tuple[str, ...] | None


class Routing(NamedTuple):
    """What ``route`` returns.

    Attributes:
      expert_ids: int32 ``[T, k]``, each token's experts, best first.
      gates: float32 ``[T, k]``, the weight of each chosen expert's output.
      tokens_per_expert: int32 ``[E]``, how many (token, expert) assignments
        each expert received (sums to ``T * k``; over ``axis_name`` as well
        when given).
      aux_loss: float32 scalar, the load-balancing loss (see
        ``load_balancing_loss``).
      probs: float32 ``[T, E]``, the per-token expert probabilities the loss
        is computed from (softmax, or the sigmoid scores normalised to sum 1).
    """

    expert_ids: jax.Array
    gates: jax.Array
    tokens_per_expert: jax.Array
    aux_loss: jax.Array
    probs: jax.Array


def route(
    logits: jax.Array,
    num_experts_per_tok: int,
    *,
    score_function: str = "softmax",
    expert_bias: jax.Array | None = None,
    normalize_gates: bool = True,
    axis_name: AxisNames = None,
) -> Routing:
    """Chooses ``num_experts_per_tok`` experts per token and their gate weights.

    Args:
      logits: ``[T, E]`` router logits; computed in float32 whatever their dtype.
      num_experts_per_tok: ``k``, experts per token, ``1 <= k <= E`` (static).
      score_function: "softmax" or "sigmoid" (see the module docstring).
      expert_bias: optional ``[E]`` bias added to the scores for the choice
        only; no gradient flows into it.
      normalize_gates: divide the ``k`` gates of a token by their sum.
      axis_name: inside ``shard_map`` with tokens split over these mesh axes,
        ``tokens_per_expert`` and the loss's two means are taken over all of
        them, so both equal what one device computes on the whole batch.

    Returns:
      A ``Routing``.

    Raises:
      ValueError: at trace time, for logits that are not 2-D, ``k`` outside
        ``[1, E]``, an unknown score function or a bias of the wrong shape.
    """
    if logits.ndim != 2:
        raise ValueError(f"te_jax.moe.route: logits must be [tokens, experts], got shape {logits.shape}")
    num_experts = logits.shape[1]
    if not isinstance(num_experts_per_tok, int) or not 1 <= num_experts_per_tok <= num_experts:
        raise ValueError(
            f"te_jax.moe.route: num_experts_per_tok must be an int in [1, num_experts={num_experts}], "
            f"got {num_experts_per_tok!r}"
        )
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"te_jax.moe.route: score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    if expert_bias is not None and expert_bias.shape != (num_experts,):
        raise ValueError(
            f"te_jax.moe.route: expert_bias must have shape ({num_experts},), got {expert_bias.shape}"
        )

    logits = logits.astype(jnp.float32)
    if score_function == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    choice = scores if expert_bias is None else scores + lax.stop_gradient(expert_bias.astype(jnp.float32))
    _, expert_ids = lax.top_k(lax.stop_gradient(choice), num_experts_per_tok)
    expert_ids = expert_ids.astype(jnp.int32)
    gates = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if normalize_gates:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)

    tokens_per_expert = expert_counts(expert_ids, num_experts)
    if axis_name is not None:
        tokens_per_expert = lax.psum(tokens_per_expert, axis_name)
    aux_loss = load_balancing_loss(probs, tokens_per_expert, axis_name=axis_name)
    return Routing(expert_ids, gates, tokens_per_expert, aux_loss, probs)


def expert_counts(expert_ids: jax.Array, num_experts: int) -> jax.Array:
    """int32 ``[num_experts]``: how often each expert occurs in ``expert_ids`` (any shape)."""
    return jnp.zeros((num_experts,), jnp.int32).at[expert_ids.reshape(-1)].add(1, mode="drop")


def load_balancing_loss(probs: jax.Array, tokens_per_expert: jax.Array, *, axis_name: AxisNames = None) -> jax.Array:
    """The Switch Transformer load-balancing loss ``E * sum_e f_e * P_e``.

    ``f_e = tokens_per_expert[e] / sum(tokens_per_expert)`` is the fraction of
    the (token, expert) assignments that went to expert ``e`` (no gradient),
    and ``P_e`` the mean over tokens of ``probs[:, e]``. Perfectly uniform
    probabilities and loads give 1.0 for any ``k``.

    Args:
      probs: float32 ``[T, E]`` per-token expert probabilities.
      tokens_per_expert: ``[E]`` assignment counts, already global when
        ``axis_name`` is given.
      axis_name: mesh axes the tokens are split over (inside ``shard_map``):
        ``P_e`` is then the mean over all of their tokens.

    Returns:
      A float32 scalar.
    """
    num_experts = probs.shape[-1]
    prob_sum = jnp.sum(probs, axis=0)
    num_tokens = probs.shape[0]
    if axis_name is not None:
        prob_sum = lax.psum(prob_sum, axis_name)
        num_tokens *= lax.axis_size(axis_name)
    counts = lax.stop_gradient(tokens_per_expert.astype(jnp.float32))
    fraction = counts / jnp.maximum(jnp.sum(counts), 1.0)
    return num_experts * jnp.sum(fraction * prob_sum / num_tokens)


def update_expert_bias(expert_bias: jax.Array, tokens_per_expert: jax.Array, rate: float) -> jax.Array:
    """One auxiliary-loss-free balancing step: ``bias + rate * sign(mean load - load)``.

    Overloaded experts' biases go down by ``rate`` and underloaded ones' up,
    as DeepSeek-V3 does after each step; ``tokens_per_expert`` should be the
    global counts (``route(..., axis_name=...)``).

    Args:
      expert_bias: float32 ``[E]``.
      tokens_per_expert: ``[E]`` assignment counts of the step.
      rate: the bias update speed (DeepSeek-V3: 0.001).

    Returns:
      The new float32 ``[E]`` bias.
    """
    load = tokens_per_expert.astype(jnp.float32)
    return expert_bias.astype(jnp.float32) + rate * jnp.sign(jnp.mean(load) - load)
