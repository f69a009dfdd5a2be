"""MaxText's ``sparse_matmul`` experts on ``te_jax.ragged_dot`` (imported by ``register``; it imports MaxText).

MaxText's dropless MoE path (``sparse_matmul=True``, ``megablox=False``,
``use_tokamax_gmm=False``) computes its experts with ``jax.lax.ragged_dot``
inside ``RoutedMoE.sparse_matmul``, which takes no quantization object.
``route_sparse_experts`` changes two things in ``maxtext.layers.moe``:

1. ``RoutedMoE.sparse_matmul`` runs under ``te_jax.autocast(recipe=...)`` when
   the layer's quantization is te_jax's (``TeJaxQuantization``), and refuses a
   stateful recipe (delayed scaling: the ragged dots have nowhere to keep an
   amax history there) and stochastic rounding (no key reaches them);
2. the module's name ``jax`` becomes a view of jax whose ``lax.ragged_dot`` is
   ``te_jax.ragged_dot`` under a te_jax autocast and ``jax.lax.ragged_dot``
   (looked up at each call) otherwise, so every other caller computes exactly
   what it computed before.

``TeJaxQuantization`` refuses the MoE paths that never reach ``ragged_dot``
(megablox, tokamax) when building the config (``te_jax.maxtext.register``).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import jax

from te_jax.core.ragged_dot import ragged_dot as te_ragged_dot
from te_jax.recipe.autocast import autocast, current_recipe

__all__ = ["route_sparse_experts"]


def _ragged_dot(*args, **kwargs):
    """``te_jax.ragged_dot`` under a te_jax autocast, else whatever ``jax.lax.ragged_dot`` is at this call."""
    return (te_ragged_dot if current_recipe() is not None else jax.lax.ragged_dot)(*args, **kwargs)


class _View(types.ModuleType):
    """A module whose ``overrides`` shadow ``target``'s attributes; every other name is ``target``'s."""

    def __init__(self, target: types.ModuleType, **overrides: Any):
        super().__init__(target.__name__, target.__doc__)
        self.__dict__.update(overrides)
        self.__dict__["te_jax_target"] = target

    def __getattr__(self, name: str):
        return getattr(self.__dict__["te_jax_target"], name)


def route_sparse_experts(moe: types.ModuleType, quantization_class: type) -> None:
    """Routes ``moe`` (``maxtext.layers.moe``)'s sparse experts to te_jax under ``quantization_class``'s
    recipes; calling it again changes nothing more."""
    routed = moe.RoutedMoE
    original = getattr(routed.sparse_matmul, "te_jax_original", routed.sparse_matmul)

    @functools.wraps(original)
    def sparse_matmul(self, *args, **kwargs):
        quant = getattr(self, "quant", None)
        if not isinstance(quant, quantization_class):
            return original(self, *args, **kwargs)
        if quant.stateful:
            raise ValueError(
                f"te_jax: MaxText quantization={quant.name!r} keeps FP8 state (delayed scaling), which the experts' "
                "ragged_dot in MaxText's sparse_matmul path has nowhere to keep: choose a stateless recipe "
                "(te_jax_current, te_jax_block, te_jax_mxfp8), or sparse_matmul=False (the experts' einsums keep "
                "delayed state)")
        if quant.needs_apply_rngs:
            raise ValueError(
                f"te_jax: MaxText quantization={quant.name!r} rounds gradients stochastically, which needs a key "
                "that MaxText's sparse_matmul path does not pass to the experts' ragged_dot: register the recipe "
                "with disable_stochastic_rounding=True (te_jax.maxtext.register({...})), or set sparse_matmul=False")
        with autocast(recipe=quant.recipe):
            return original(self, *args, **kwargs)

    sparse_matmul.te_jax_original = original
    routed.sparse_matmul = sparse_matmul
    if not isinstance(moe.jax, _View):
        moe.jax = _View(jax, lax=_View(jax.lax, ragged_dot=_ragged_dot))
