"""The forward half of an op's state update, recorded where no backward pass will carry it.

Training carries a layer's FP8 state update as the gradient of its state
(``te_jax.train``): the op's backward returns it. When the layer's output
gets no gradient (``jax.lax.stop_gradient``, a frozen encoder, a teacher),
JAX never runs that backward, and the state of the forward roles (input,
weight, output) would never move. So every functional op also returns the
update form of its forward roles (``ForwardUpdate``, with the forward-updated
state), and ``split`` (called by ``te_jax.core.updated_state``) hands it to
the recorders open around the call:

* ``te_jax.train.value_and_grad`` records around the differentiated
  function and max-merges what it recorded into the gradient of
  "fp8_meta" (and of "fp8_stats"); where the backward ran, that gradient
  already holds the same forms, and max leaves it as it is;
* ``te_jax.flax``'s ``call_op`` records around a mutable apply, so that a
  layer called twice merges its updates as training does;
* ``te_jax.nnx.calibrate`` records a forward pass and applies it.

A recorder (``ForwardUpdates``) knows the state leaves it records for by
identity (the very arrays its caller passes in) and the trace it was opened
in. An op whose state leaves are other arrays records nothing there; one
that runs in another trace (inside ``jax.checkpoint`` / ``nn.remat``,
``scan``, ``vmap``, ``shard_map``: its results could not leave that trace)
records nothing and is counted in ``ForwardUpdates.missed``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import get_opaque_trace_state

from te_jax.ops.sharding import match_cotangent, varying_axes
from te_jax.recipe import ROLES


class ForwardUpdate(NamedTuple):
    """A stateful role's forward-updated state and the update form of it (``StatefulQuantizer.state_gradient``),
    as a functional op's custom VJP returns them (a pytree)."""

    state: Any
    update: Any


def _trace():
    return get_opaque_trace_state(convention="te_jax")


class ForwardUpdates:
    """Records the forward update forms of the states whose leaves are those of ``tree`` (module docstring).

    Args:
      tree: the states (any pytree of arrays: "fp8_meta", a layer's role states, statistics inputs).
    """

    def __init__(self, tree: Any):
        leaves, self._treedef = jax.tree.flatten(tree)
        self._leaves = leaves
        self._index = {id(v): i for i, v in enumerate(leaves)}
        self._forms: dict[int, jax.Array] = {}
        self._trace = _trace()
        self.missed = 0  # op calls that ran in another trace (an inner transformation): nothing recorded

    def record(self, state: Any, form: Any) -> None:
        """Records ``form`` for ``state`` (one state, or a mapping of them laid out like ``form``); uses of one
        leaf merge by max."""
        if _trace() != self._trace:
            self.missed += 1
            return
        for s, f in _pairs(state, form):
            i = self._index.get(id(s))
            if i is None:
                continue
            f = match_cotangent(jnp.asarray(f, jnp.float32), varying_axes(f), varying_axes(s), "max")
            self._forms[i] = f if i not in self._forms else jnp.maximum(self._forms[i], f)

    @property
    def recorded(self) -> frozenset[int]:
        """The indices (in ``tree``'s leaf order) of the leaves with a recorded form."""
        return frozenset(self._forms)

    def updates(self) -> Any:
        """The recorded forms laid out like ``tree`` (float32); -inf (unused, the max-merge's zero) elsewhere."""
        return self._treedef.unflatten([self._forms.get(i, jnp.full(jnp.shape(v), -jnp.inf, jnp.float32))
                                        for i, v in enumerate(self._leaves)])


class CotangentMarks:
    """Which leaves of ``tree`` a backward pass reaches: ``tree`` is ``tree`` through an identity whose
    backward, when JAX traces it (it does not for a leaf whose cotangent is zero), marks the leaf's index."""

    def __init__(self, tree: Any):
        self.marked: set[int] = set()

        @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
        def tap(index, x):
            return x

        def backward(index, _, ct):
            self.marked.add(index)
            return (ct,)

        tap.defvjp(lambda index, x: (x, None), backward)
        leaves, treedef = jax.tree.flatten(tree)
        self.tree = treedef.unflatten([tap(i, v) for i, v in enumerate(leaves)])


def _pairs(state: Any, form: Any) -> Iterator[tuple[Any, Any]]:
    """``(state leaf, form leaf)`` at the same keys of two nested mappings (keys only one has are skipped)."""
    if isinstance(form, Mapping):
        if isinstance(state, Mapping):
            for k, f in form.items():
                if k in state:
                    yield from _pairs(state[k], f)
        return
    if isinstance(state, Mapping) or state is None or form is None:
        return
    yield state, form


_recorders: contextvars.ContextVar[tuple[ForwardUpdates, ...]] = contextvars.ContextVar("te_jax_forward_updates",
                                                                                        default=())


@contextlib.contextmanager
def record_forward_updates(tree: Any) -> Iterator[ForwardUpdates]:
    """Context manager: a ``ForwardUpdates`` of ``tree`` that the functional ops called inside record into.

    Open it in the trace the ops run in (inside the function ``jax.vjp`` or
    ``jax.jit`` traces); recorders nest, and every open one records.
    """
    recorder = ForwardUpdates(tree)
    token = _recorders.set((*_recorders.get(), recorder))
    try:
        yield recorder
    finally:
        _recorders.reset(token)


def split(state: Mapping | None, updates: Mapping, stats_in: Any = None, fwd_stats: Any = None) -> dict:
    """``updates`` with each ``ForwardUpdate`` replaced by its state, its form recorded for the matching entry
    of ``state`` (and the forward statistics ``fwd_stats`` for the statistics input ``stats_in``)."""
    recorders = _recorders.get()

    def walk(given: Any, node: Any) -> Any:
        if isinstance(node, ForwardUpdate):
            for r in recorders:
                r.record(given, node.update)
            return node.state
        if isinstance(node, Mapping):
            return {k: walk(given.get(k) if isinstance(given, Mapping) else None, v) for k, v in node.items()}
        return node

    out = walk(state, updates)
    if fwd_stats is not None:
        for r in recorders:
            r.record(stats_in, fwd_stats)
    return out


def warn_never_updated(recorder: ForwardUpdates, marks: CotangentMarks, tree: Any, collection: str) -> None:
    """Warns when states of ``tree[collection]`` got neither a recorded forward update nor a cotangent while some
    op ran in another trace (``recorder.missed``): their state does not move this step.

    ``recorder`` and ``marks`` were made over ``tree`` (same leaves, same order); the warning is issued once per
    set of states (Python's warning registry).
    """
    if not recorder.missed:
        return
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    never = sorted({_layer_name(path[1:], collection) for i, (path, _) in enumerate(leaves)
                    if i not in recorder.recorded and i not in marks.marked
                    and path[:1] == (jax.tree_util.DictKey(collection),)})
    if never:
        warnings.warn(
            f"te_jax: the FP8 state of {', '.join(never[:4])}{' and more' if len(never) > 4 else ''} gets no update "
            f"this step: its layer's output gets no gradient (jax.lax.stop_gradient, a frozen branch) and it runs "
            f"inside a JAX transformation (jax.checkpoint / nn.remat, scan, vmap, shard_map) where te_jax cannot "
            f"record its forward update (or it is not called). Call it outside that transformation, or calibrate "
            f"its state with a forward pass outside it: Linen model.apply(variables, x, mutable=[{collection!r}]), "
            f"NNX te_jax.nnx.calibrate(fn)(model, x)", stacklevel=4)


def _layer_name(path: tuple, collection: str) -> str:
    """The layer of a state leaf at ``path`` (below the collection): the keys before its role, without an NNX
    layer's ``collection`` attribute and its Variable's ``value``."""
    names = []
    for key in path:
        name = str(getattr(key, "key", getattr(key, "name", key)))
        if name in ROLES:
            break
        if not (name == collection or isinstance(key, jax.tree_util.GetAttrKey)):
            names.append(name)
    return "/".join(names)
