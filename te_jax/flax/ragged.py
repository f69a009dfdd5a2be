"""``te_jax.flax.RaggedDot``: ``jax.lax.ragged_dot`` as a Linen module that keeps the FP8 state of its GEMMs.

A mixture-of-experts layer that takes its ragged dot as an argument (or
calls ``jax.lax.ragged_dot`` where a submodule can go) injects it::

    self.ragged_dot = te_jax.flax.RaggedDot()              # in setup, or inline in a compact __call__
    h = self.ragged_dot(x_sorted, wi, group_sizes)          # was jax.lax.ragged_dot(x_sorted, wi, group_sizes)

It computes ``te_jax.ragged_dot`` (``te_jax.core.ragged_dot``): exactly
``jax.lax.ragged_dot`` outside ``te_jax.autocast``, the recipe's quantized
grouped GEMMs under it. Unlike the function it works under every recipe,
delayed scaling included: like ``te_jax.flax.DotGeneral`` (the other
injected module) it keeps the state in flax's "_overwrite_with_gradient"
collection (``te_jax.quantize.overwrite``: its gradient is its new value;
``_overwrite_with_gradient/<path>/<role>``, the weight's with one amax
history per expert, the leading ``g`` axis), created by ``init`` under the
recipe, so flax's TrainState, a plain optax loop and ``te_jax.train`` keep
it right. Stochastic rounding (NVFP4) draws its key from the "quantize" RNG
stream (``apply(..., rngs={"quantize": key})``).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from te_jax.core.gemm_quant import FP8StateError, fp8_state_updates
from te_jax.core.ragged_dot import quantizers_for, ragged_dot_with_state
from te_jax.flax._common import module_path, quantize_key, where
from te_jax.flax.inject import overwrite_state
from te_jax.moe.experts import ExpertQuantizers


def ragged_dot_call(module: nn.Module, path, lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
                    *, name: str | None = None, where_: str) -> jax.Array:
    """``te_jax.ragged_dot`` with ``module``'s "_overwrite_with_gradient" state (``name``: as ``overwrite_state``)."""
    q = quantizers_for(path)
    state = {}
    if q.stateful():
        num_groups = rhs.shape[0] if getattr(rhs, "ndim", 0) == 3 else 0
        state, rhs = overwrite_state(module, q, ExpertQuantizers(q, num_groups).init_state(), rhs, where_, name)
    key = quantize_key(module, q.any)
    try:
        with fp8_state_updates():  # the overwrite form applies the update: its gradient is the new state
            y, _ = ragged_dot_with_state(lhs, rhs, group_sizes, precision, preferred_element_type, quantizers=q,
                                         state=state, key=key, where=where_)
    except FP8StateError:
        raise
    except ValueError as err:
        raise ValueError(str(err).replace("te_jax: ragged_dot", f"te_jax: {where_}", 1)) from None
    return y


class RaggedDot(nn.Module):
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)``, quantized under ``te_jax.autocast`` with FP8 state.

    No parameters: ``rhs`` (the experts' weights) belongs to the calling layer. The recipe is asked for this
    module's path (``te_jax.recipe.Role.path``), e.g. ``("MoE_0", "wi_dot")``.
    """

    @nn.compact
    def __call__(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, precision=None,
                 preferred_element_type=None) -> jax.Array:
        """``[m, k] x [g, k, n]`` -> ``[m, n]``, as ``jax.lax.ragged_dot`` (see ``te_jax.ragged_dot``)."""
        return ragged_dot_call(self, module_path(self), lhs, rhs, group_sizes, precision, preferred_element_type,
                               where_=where(self))
