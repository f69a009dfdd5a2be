"""``name_paths``: every te_jax.nnx layer of a model learns its module path from the model's graph.

An NNX module is built before its parent assigns it to an attribute, so a
layer does not know where it sits when it is constructed. ``name_paths``
walks the model once built and gives each te_jax layer whose ``path`` was
not given its path in the graph (``"blocks/0/attn/q_proj"``), the path a
``CustomRecipe``'s roles then carry and ``te_jax.inspect`` names its rows
by. A layer built under a recipe that chooses by path before its path was
known creates its FP8 state here, from the autocast it was built under.
``te_jax.nnx.value_and_grad`` and ``te_jax.nnx.inject`` call it.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from te_jax.nnx._fp8 import Layer, create_fp8


def _owners(model: Any) -> dict[int, tuple[Layer, list[tuple[str, ...]]]]:
    """``{id: (op, [the paths it is referenced from])}`` for every single-owner layer (injected op) of ``model``."""
    owners: dict[int, tuple[Layer, list[tuple[str, ...]]]] = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable) or not nnx.graph.is_graph_node(node):
            continue
        for name, child in nnx.iter_children(node):
            if isinstance(child, Layer) and child.single_owner:
                owners.setdefault(id(child), (child, []))[1].append((*map(str, path), str(name)))
    return owners


def check_single_owners(model: Any) -> None:
    """Raises a clear error when an injected ``DotGeneral`` / ``EinsumOp`` is referenced from several places."""
    for op, paths in _owners(model).values():
        if len(paths) > 1:
            names = ", ".join("/".join(p) for p in sorted(paths))
            raise ValueError(
                f"te_jax: one {type(op).__name__} is referenced from {len(paths)} places ({names}): each layer needs "
                f"its own te_jax.nnx.{type(op).__name__}(), since one shared by several layers would merge their "
                "FP8 state and statistics. Give each layer a new instance; nnx.MultiHeadAttention hands its "
                "qkv_dot_general to query, key and value and keeps references to it and to out_dot_general: build "
                "it without them and call te_jax.nnx.inject(model)")


def name_paths(model: Any) -> Any:
    """Names every te_jax.nnx layer of ``model`` by its path in the model's graph; returns ``model``.

    A layer built with ``path=`` keeps it (and its sub-layers theirs). A
    layer reached by several paths (a shared module) takes the first one
    ``nnx.iter_graph`` meets. A layer that was built under a recipe choosing
    by path (a ``CustomRecipe``) while its path was not known creates its FP8
    state now (``te_jax.nnx.FP8Meta``, and ``FP8Stats`` when built under
    ``inspect=True``), from that recipe at its path. Calling it again changes
    nothing; inside ``nnx.jit`` the changes reach the caller's model as
    ``nnx.jit`` propagates them.

    Args:
      model: an ``nnx.Module`` (or any graph node holding te_jax.nnx layers).

    Raises:
      ValueError: one injected ``te_jax.nnx.DotGeneral`` / ``EinsumOp`` is
        referenced from several places (each layer needs its own).
    """
    check_single_owners(model)
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, Layer) or node.path_given:
            continue
        graph_path = tuple(map(str, path))
        if node.path != graph_path:
            node.path = graph_path
        pending = getattr(node, "fp8_pending", None)
        if pending is not None:
            create_fp8(node, pending.recipe, pending.inspect)
            node.fp8_pending = None
    return model
