"""How a te_jax.nnx layer knows its module path, keeps its FP8 state and runs its functional op.

Every te_jax.nnx layer is a ``Layer``: it knows its module path, given as
``path=`` (fixed) or, left out, named from the model's graph by
``te_jax.nnx.name_paths(model)`` (which ``te_jax.nnx.value_and_grad`` and
``te_jax.nnx.inject`` call). At construction a layer asks the active
``te_jax.autocast`` recipe which of its roles keep state and creates an
``FP8Meta`` holding their initial state (and, under ``inspect=True``, an
``FP8Stats``); it keeps a fork of the ``nnx.Rngs`` stream "quantize" when one
is given. A recipe that chooses quantizers by module path (a
``CustomRecipe``) cannot answer for a layer whose path is not known yet: such
a layer keeps the construction recipe (``PendingFP8``) and creates its state
when it is named. A call reads the recipe again, hands the state to the
functional op and leaves the variables as they are: the update after forward
and backward is applied by ``te_jax.nnx.value_and_grad``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
from flax import nnx

from te_jax.core import with_stats
from te_jax.core.layer_support import describe, located
from te_jax.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, \
    NVFP4BlockScaling, Recipe
from te_jax.recipe.autocast import current_recipe, inspect_sample, inspecting
from te_jax.core import stats as inspect_stats
from te_jax.spec.names import QUANTIZE_RNG
from te_jax.nnx.variables import FP8Meta, FP8Stats

NAME_PATHS = ("call te_jax.nnx.name_paths(model) once the model is built, under the autocast it was built with "
              "(te_jax.nnx.value_and_grad and te_jax.nnx.inject do it too), or pass path=")
_CONSTRUCT = ("construct the model under te_jax.autocast(recipe=...) with the recipe it is called under, and train "
              "it with te_jax.nnx.value_and_grad; a recipe that chooses layers by module path needs the paths: "
              + NAME_PATHS)
# The built-in recipes' quantizer methods, which never read a role's path.
_PATH_BLIND = frozenset(cls.quantizer for cls in (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling,
                                                  NVFP4BlockScaling, Float8BlockScaling))


def where(layer: nnx.Module) -> str:
    """``"LayerNormMLP at block/mlp"`` for error messages (the layer's ``path``; unnamed: the class only)."""
    return describe(layer, getattr(layer, "path", None) or ())


def as_path(path: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """A module path from ``"a/b"`` or ``("a", "b")``; None (not known yet) stays None."""
    if path is None:
        return None
    return tuple(p for p in path.split("/") if p) if isinstance(path, str) else tuple(str(p) for p in path)


def recipe_or_none():
    """The active autocast's recipe (None outside autocast or when disabled)."""
    return current_recipe()


def reads_path(recipe: Recipe | None) -> bool:
    """Whether ``recipe`` may choose quantizers by module path: a ``CustomRecipe``, or any recipe whose
    ``quantizer`` method is not a built-in recipe's."""
    return recipe is not None and type(recipe).quantizer not in _PATH_BLIND


@dataclasses.dataclass(frozen=True)
class PendingFP8:
    """The autocast a layer was built under when its recipe reads paths and its path was not known yet.

    ``te_jax.nnx.name_paths`` creates the layer's FP8 state from it once the path is known.
    """

    recipe: Recipe
    inspect: bool


class Layer(nnx.Module):
    """A te_jax.nnx layer: its module path and, for the layers that quantize, how it asks a recipe.

    Attributes:
      path: the module path the recipe's roles carry and errors name; None
        until ``te_jax.nnx.name_paths`` names the layer from the model's graph.
      path_given: whether ``path`` was given (``path=``): naming never changes it.
      fp8_gemms: None for one GEMM, else the GEMMs' names (an MLP's "wi", "wo").
      single_owner: the layer is meant for one owner (an injected dot_general
        or einsum_op): ``name_paths`` refuses one referenced from several places.
    """

    fp8_gemms: ClassVar[tuple[str, ...] | None] = None
    single_owner: ClassVar[bool] = False

    def set_path(self, path: str | Sequence[str] | None) -> None:
        """Sets ``path`` (None: to be named from the graph)."""
        self.path = as_path(path)
        self.path_given = path is not None

    def child_path(self, *names: str) -> tuple[str, ...] | None:
        """A sub-layer's path: this layer's plus ``names`` (None while this one's is not known)."""
        return None if self.path is None else self.path + names

    def fp8_quantizers(self, recipe: Recipe | None):
        """The layer's quantizer bundle under ``recipe`` at its path (layers that quantize override it)."""
        raise NotImplementedError

    def fp8_initial_state(self, quantizers) -> dict[str, Any]:
        """The initial FP8 state of ``quantizers``: ``{role: state}``, or ``{gemm: {role: state}}``.

        Each bundle's own ``init_state``: an MoE's expert GEMMs give their
        weights' state the experts' leading axis.
        """
        if self.fp8_gemms is None:
            return quantizers.init_state()
        return {g: quantizers.by_gemm()[g].init_state() for g in self.fp8_gemms}


def call_quantizers(layer: Layer):
    """The layer's quantizers under the active recipe; a clear error when the recipe needs a path not known yet."""
    recipe = recipe_or_none()
    if layer.path is None and reads_path(recipe):
        raise ValueError(f"te_jax: {where(layer)}: {type(recipe).__name__} chooses quantizers by module path, and "
                         f"this layer's path is not known yet: {NAME_PATHS}")
    return layer.fp8_quantizers(recipe)


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


def init_fp8(layer: Layer, rngs: nnx.Rngs | None) -> None:
    """Sets ``layer.fp8_meta``, ``fp8_stats``, ``fp8_pending`` and ``quantize_rngs`` at construction.

    The quantizers come from the active recipe at the layer's path (none
    outside autocast). A recipe that reads paths, for a layer whose path is
    not known yet, is kept in ``fp8_pending`` and the state is created by
    ``te_jax.nnx.name_paths``; a variable the recipe does not need is None,
    so that a model built outside autocast holds exactly flax.nnx's variables.
    """
    recipe = recipe_or_none()
    pending = layer.path is None and reads_path(recipe)
    layer.fp8_pending = PendingFP8(recipe, inspecting()) if pending else None
    create_fp8(layer, None if pending else recipe, inspecting())
    if rngs is not None and QUANTIZE_RNG in rngs:
        layer.quantize_rngs = rngs[QUANTIZE_RNG].fork()
    else:
        layer.quantize_rngs = nnx.data(None)


def create_fp8(layer: Layer, recipe: Recipe | None, inspect: bool) -> None:
    """Sets ``layer.fp8_meta`` (and ``fp8_stats`` when ``inspect``) to the initial state ``recipe`` gives the
    layer at its path."""
    quantizers, gemms = layer.fp8_quantizers(recipe), layer.fp8_gemms
    state = layer.fp8_initial_state(quantizers)
    layer.fp8_meta = FP8Meta(state) if jax.tree.leaves(state) else nnx.data(None)
    roles = _roles(quantizers, gemms)
    if inspect and roles:
        stats = inspect_stats.zeros(roles) if gemms is None else {g: inspect_stats.zeros(r) for g, r in roles.items()}
        layer.fp8_stats = FP8Stats(stats)
    else:
        layer.fp8_stats = nnx.data(None)


def _state(layer: Layer, quantizers, gemms: Sequence[str] | None) -> dict[str, Any]:
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


def _stats(layer: Layer, quantizers, gemms: Sequence[str] | None) -> dict[str, Any] | None:
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


def run_op(layer: Layer, quantizers, op: Callable) -> jax.Array:
    """``op(state=..., key=..., inspect=...) -> (y, new_state)`` with the layer's FP8 state, statistics and key.

    Args:
      layer: the calling layer (``fp8_meta``, ``fp8_stats``, ``quantize_rngs``, ``path``, ``fp8_gemms``).
      quantizers: its quantizers for this call (``call_quantizers``): a ``DenseQuantizers``, or for a layer with
        ``fp8_gemms`` a bundle with ``by_gemm()``.
      op: the functional op with every other argument bound.

    Returns:
      y. The op's forward-updated state is not stored (see the module docstring); its errors name the layer.
    """
    gemms = layer.fp8_gemms
    state, stats = _state(layer, quantizers, gemms), _stats(layer, quantizers, gemms)
    key = layer.quantize_rngs() if quantizers.any and layer.quantize_rngs is not None else None
    try:
        y, _ = op(state=with_stats(state, stats), key=key, inspect=inspect_sample() if stats is not None else False)
    except ValueError as err:
        raise located(err, where(layer)) from None
    return y
