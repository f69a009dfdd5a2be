"""How a te_jax.nnx layer keeps its FP8 state and runs its functional op.

At construction a layer asks the active ``te_jax.autocast`` recipe which of
its roles keep state and creates an ``FP8Meta`` holding their initial state
(and, under ``inspect=True``, an ``FP8Stats``); it keeps a fork of the
``nnx.Rngs`` stream "quantize" when one is given. A call reads the recipe
again, hands the state to ``te_jax.dense`` / ``layernorm_dense`` /
``layernorm_mlp`` and leaves the variables as they are: the update after
forward and backward is applied by ``te_jax.nnx.value_and_grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from te_jax.core import with_stats
from te_jax.core.layer_support import describe, located
from te_jax.recipe.autocast import current_recipe, inspect_sample, inspecting
from te_jax.core import stats as inspect_stats
from te_jax.spec.names import QUANTIZE_RNG
from te_jax.nnx.variables import FP8Meta, FP8Stats

_CONSTRUCT = ("construct the model under te_jax.autocast(recipe=...) with the recipe it is called under, and train "
              "it with te_jax.nnx.value_and_grad")


def where(layer: nnx.Module) -> str:
    """``"LayerNormMLP at block/mlp"`` for error messages (the layer's ``path``)."""
    return describe(layer, layer.path)


def as_path(path: str | Sequence[str]) -> tuple[str, ...]:
    """A module path from ``"a/b"`` or ``("a", "b")``."""
    return tuple(p for p in path.split("/") if p) if isinstance(path, str) else tuple(str(p) for p in path)


def recipe_or_none():
    """The active autocast's recipe (None outside autocast or when disabled)."""
    return current_recipe()


def _roles(quantizers, gemms: Sequence[str] | None) -> dict | tuple:
    """The quantized roles: a tuple, or ``{gemm: roles}`` for the GEMMs that quantize any."""
    if gemms is None:
        return quantizers.quantized_roles()
    bundles = quantizers.by_gemm()
    return {g: bundles[g].quantized_roles() for g in gemms if bundles[g].any}


def _stateful(quantizers, gemms: Sequence[str] | None) -> dict:
    """``{role: quantizer}``, or ``{gemm: {role: quantizer}}``, of the roles that keep state."""
    if gemms is None:
        return quantizers.stateful()
    return {g: quantizers.by_gemm()[g].stateful() for g in gemms}


def init_fp8(layer: nnx.Module, quantizers, rngs: nnx.Rngs | None, gemms: Sequence[str] | None = None) -> None:
    """Sets ``layer.fp8_meta``, ``layer.fp8_stats`` and ``layer.quantize_rngs`` at construction.

    ``quantizers`` come from the active recipe (empty outside autocast);
    a variable the recipe does not need is None, so that a model built
    outside autocast holds exactly flax.nnx's variables.
    """
    # Each bundle's own init_state: an MoE's expert GEMMs give their weights' state the experts' leading axis.
    if gemms is None:
        state = quantizers.init_state()
    else:
        state = {g: quantizers.by_gemm()[g].init_state() for g in gemms}
    layer.fp8_meta = FP8Meta(state) if jax.tree.leaves(state) else nnx.data(None)
    roles = _roles(quantizers, gemms)
    if inspecting() and roles:
        stats = inspect_stats.zeros(roles) if gemms is None else {g: inspect_stats.zeros(r) for g, r in roles.items()}
        layer.fp8_stats = FP8Stats(stats)
    else:
        layer.fp8_stats = nnx.data(None)
    if rngs is not None and QUANTIZE_RNG in rngs:
        layer.quantize_rngs = rngs[QUANTIZE_RNG].fork()
    else:
        layer.quantize_rngs = nnx.data(None)


def _state(layer: nnx.Module, quantizers, gemms: Sequence[str] | None) -> dict[str, Any]:
    """The state the op needs, read from ``layer.fp8_meta`` (a clear error when the layer lacks it)."""
    need = _stateful(quantizers, gemms)
    if not (any(need.values()) if gemms is not None else need):
        return need  # nothing keeps state: {} or {gemm: {}}
    have = layer.fp8_meta.get_value() if layer.fp8_meta is not None else {}
    if gemms is None:
        missing = [r for r in need if r not in have]
    else:
        missing = [f"{g}/{r}" for g, roles in need.items() for r in roles if r not in have.get(g, {})]
    if missing:
        raise ValueError(f"te_jax: {where(layer)} has no FP8Meta state for {missing}, which this recipe keeps: "
                         f"{_CONSTRUCT}")
    if gemms is None:
        return {r: have[r] for r in need}
    return {g: {r: have[g][r] for r in roles} for g, roles in need.items()}


def _stats(layer: nnx.Module, quantizers, gemms: Sequence[str] | None) -> dict[str, Any] | None:
    """The statistics input from ``layer.fp8_stats`` when inspecting (``te_jax.inspect``), else None."""
    roles = _roles(quantizers, gemms)
    if not inspecting() or not roles:
        return None
    have = layer.fp8_stats.get_value() if layer.fp8_stats is not None else {}
    missing = ([r for r in roles if r not in have] if gemms is None else
               [f"{g}/{r}" for g, rs in roles.items() for r in rs if r not in have.get(g, {})])
    if missing:
        raise ValueError(f"te_jax: {where(layer)} has no FP8Stats entry for {missing}, which inspect=True needs: "
                         "construct the model under te_jax.autocast(..., inspect=True) with this recipe")
    return dict(have)


def run_op(layer: nnx.Module, quantizers, op: Callable, gemms: Sequence[str] | None = None) -> jax.Array:
    """``op(state=..., key=..., inspect=...) -> (y, new_state)`` with the layer's FP8 state, statistics and key.

    Args:
      layer: the calling layer (``fp8_meta``, ``fp8_stats``, ``quantize_rngs``, ``path``).
      quantizers: its quantizers for this call: a ``DenseQuantizers``, or with ``gemms`` an ``MLPQuantizers``.
      op: the functional op with every other argument bound.
      gemms: None for one GEMM, else the GEMMs' names.

    Returns:
      y. The op's forward-updated state is not stored (see the module docstring); its errors name the layer.
    """
    state, stats = _state(layer, quantizers, gemms), _stats(layer, quantizers, gemms)
    key = layer.quantize_rngs() if quantizers.any and layer.quantize_rngs is not None else None
    try:
        y, _ = op(state=with_stats(state, stats), key=key, inspect=inspect_sample() if stats is not None else False)
    except ValueError as err:
        raise located(err, where(layer)) from None
    return y

