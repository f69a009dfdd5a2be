"""``te_jax.autocast``: the block of code in which te_jax layers quantize.

::

    with te_jax.autocast(recipe=te_jax.recipe.Float8CurrentScaling()):
        y = model.apply(variables, x)

The setting is read when a layer is traced. It is part of jit's cache key,
so a function compiled outside the block is traced again inside it (and vice
versa). Blocks nest; the innermost one wins, and an inner
``autocast(enabled=False)`` turns quantization off for its body. Outside any
block, te_jax layers compute in high precision. An inner block inherits every
argument it does not set. The setting is a JAX user context (as is
``te_jax.ops.backend``'s choice of implementation), not a global flag: it is read
only while tracing and never changed by it.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import numpy as np

from te_jax.recipe import recipes as recipe_lib
from te_jax.ops.sharding import MeshResource


@dataclasses.dataclass(frozen=True)
class Sample:
    """Which rows of a tensor its statistics read (``te_jax.autocast(inspect=Sample(every=8))``).

    Attributes:
      every: read rows 0, every, 2 * every, ... of each activation and
        gradient (1: every row, the exact statistics; ``inspect=True`` means
        ``Sample()``). The cost of inspection falls, though not in proportion
        (part of it is per tensor, not per row).
    """

    every: int = 1

    def __post_init__(self):
        every = self.every
        if isinstance(every, (bool, np.bool_)) or not isinstance(every, numbers.Integral) or every < 1:
            raise ValueError(f"te_jax: inspect Sample(every=...) must be a positive int, got {every!r}")
        object.__setattr__(self, "every", int(every))


def as_sample(inspect) -> Sample | None:
    """The sampling an ``inspect`` argument asks for: None when off (False/None), ``Sample()`` for True."""
    if isinstance(inspect, Sample):
        return inspect
    if inspect is None or isinstance(inspect, (bool, np.bool_)):
        return Sample() if inspect else None
    raise ValueError(f"te_jax: inspect must be True, False or a te_jax.inspect.Sample, got {inspect!r}")



@dataclasses.dataclass(frozen=True)
class AutocastConfig:
    """What an autocast block sets: whether to quantize, how, and the mesh axes.

    Attributes:
      enabled: quantize te_jax layers.
      recipe: the recipe (kept while disabled, for an inner block that enables
        quantization again; ``current_recipe()`` is None then).
      mesh_resource: the mesh axes amaxes are reduced over, or None.
      inspect: the rows quantization statistics read (``te_jax.inspect.Sample``),
        or None: no statistics (``inspect_sample()`` is None while disabled).
    """

    enabled: bool = False
    recipe: recipe_lib.Recipe | None = None
    mesh_resource: MeshResource | None = None
    inspect: Sample | None = None


_current = jax.make_user_context(default_value=AutocastConfig())


class _Inherit:
    """The default of ``autocast``'s arguments: take the enclosing block's value."""

    def __repr__(self) -> str:
        return "<inherited>"


INHERIT = _Inherit()


def autocast(enabled: bool = True, recipe: recipe_lib.Recipe | None | _Inherit = INHERIT,
             mesh_resource: MeshResource | None | _Inherit = INHERIT, inspect: bool | Sample | _Inherit = INHERIT):
    """Context manager: te_jax layers traced inside it quantize with ``recipe``.

    Every argument but ``enabled`` that is not given takes the enclosing
    block's value (outside any block: ``DelayedScaling()``, None, False), so
    an inner ``autocast(enabled=False)`` keeps the outer mesh axes and an
    inner block re-enabling quantization keeps the outer recipe.

    Args:
      enabled: False computes in high precision (also inside an enabled block).
      recipe: a ``te_jax.recipe`` recipe; None means ``DelayedScaling()``.
      mesh_resource: ``te_jax.MeshResource`` naming the mesh axes that amaxes
        are reduced over inside shard_map; None reduces over every manual axis.
      inspect: also compute every quantized tensor's statistics and return
        them through the "fp8_stats" collection (``te_jax.inspect``): True
        reads every row, ``te_jax.inspect.Sample(every=k)`` every k-th row of
        activations and gradients (cheaper; not k-fold: some of the cost is per tensor). Off, the
        traced program is exactly the one without inspection.
    """
    outer = current()
    if not isinstance(enabled, bool):
        raise ValueError(f"te_jax: autocast(enabled=...) must be True or False, got {enabled!r}")
    sample = outer.inspect
    if inspect is not INHERIT:
        try:
            sample = as_sample(inspect)
        except ValueError:
            raise ValueError(f"te_jax: autocast(inspect=...) must be True, False or a te_jax.inspect.Sample, "
                             f"got {inspect!r}") from None
    if recipe is INHERIT:
        recipe = outer.recipe
    elif recipe is not None and not isinstance(recipe, recipe_lib.Recipe):
        raise ValueError(
            f"te_jax: autocast(recipe=...) must be a te_jax.recipe recipe (DelayedScaling, Float8CurrentScaling, "
            f"MXFP8BlockScaling, NVFP4BlockScaling, Float8BlockScaling, CustomRecipe), got {recipe!r}"
        )
    if mesh_resource is INHERIT:
        mesh_resource = outer.mesh_resource
    elif mesh_resource is not None and not isinstance(mesh_resource, MeshResource):
        raise ValueError(f"te_jax: autocast(mesh_resource=...) must be a te_jax.MeshResource, got {mesh_resource!r}")
    if enabled and recipe is None:
        recipe = recipe_lib.DelayedScaling()
    return _current(AutocastConfig(enabled, recipe, mesh_resource, sample))


def mesh_scope(mesh_resource: MeshResource | None):
    """Context: the current setting with ``mesh_resource``; a custom VJP's backward, traced after the
    forward's autocast block has exited, uses it to partition its GEMMs as the forward did."""
    return _current(dataclasses.replace(current(), mesh_resource=mesh_resource))


def with_plan_mesh(backward):
    """``backward(plan, res, cts)`` of a custom VJP run under ``mesh_scope(plan.mesh_resource)``."""

    def run(plan, res, cts):
        with mesh_scope(plan.mesh_resource):
            return backward(plan, res, cts)

    return run


def current() -> AutocastConfig:
    """The innermost autocast's setting (disabled outside any block)."""
    return _current.value


def inspecting() -> bool:
    """Whether the innermost autocast quantizes and collects statistics."""
    return inspect_sample() is not None


def inspect_sample() -> Sample | None:
    """The rows statistics read under the innermost autocast (None: not collecting statistics)."""
    config = current()
    return config.inspect if config.enabled else None


def current_recipe() -> recipe_lib.Recipe | None:
    """The active recipe, or None when quantization is off."""
    config = current()
    return config.recipe if config.enabled else None
