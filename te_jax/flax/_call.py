"""How a te_jax.flax layer runs its functional op: state and statistics from its collections and back."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax

from te_jax.core import split_stats, with_stats
from te_jax.core.layer_support import located
from te_jax.flax import _common as C


def call_op(module: nn.Module, quantizers, op: Callable, gemms: Sequence[str] | None = None) -> jax.Array:
    """``op(state=..., key=..., inspect=...) -> (y, new_state)`` with the layer's FP8 state and statistics.

    Args:
      module: the layer (call from its compact ``__call__``).
      quantizers: its quantizers: a ``DenseQuantizers``, or with ``gemms`` a
        bundle with one ``DenseQuantizers`` attribute per GEMM (``MLPQuantizers``).
      op: the functional op with every other argument bound.
      gemms: None for a layer with one GEMM (entries ``<path>/<role>``), else
        the GEMMs' names (entries ``<path>/<gemm>/<role>``).

    Returns:
      y. The forward-updated state and the forward statistics are stored in
      "fp8_meta" and "fp8_stats" where those collections are mutable; the op's
      errors name the module.
    """
    if gemms is None:
        state, stats = C.gemm_state(module, quantizers), C.stats_input(module, quantizers)
        inspect = C.inspect_arg(stats)
    else:
        state = {g: C.gemm_state(module, getattr(quantizers, g), g) for g in gemms}
        each = {g: C.stats_input(module, getattr(quantizers, g), g) for g in gemms}
        inspect = C.inspect_arg(*each.values())
        stats = {g: v for g, v in each.items() if v is not None} if inspect else None
    try:
        y, new_state = op(state=with_stats(state, stats), key=C.quantize_key(module, quantizers.any), inspect=inspect)
    except ValueError as err:
        raise located(err, C.where(module)) from None
    new_state, fwd_stats = split_stats(new_state)
    if gemms is None:
        C.store_gemm_state(module, new_state)
        C.store_stats(module, fwd_stats)
    else:
        for g in gemms:
            C.store_gemm_state(module, new_state.get(g), g)
            C.store_stats(module, (fwd_stats or {}).get(g), g)
    return y
