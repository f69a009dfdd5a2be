"""Training with FP8 state: gradients that carry the state update, TrainState, accumulation.

The state after forward and backward comes back as the gradient of
``variables["fp8_meta"]`` (the update form, below). Turning a
bf16 train step into an FP8 one changes three lines::

    state = te_jax.train.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)  # whole variables

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(params):
            return loss(state.apply_fn(params, x), y)                     # 1: was {"params": params}
        with te_jax.autocast(recipe=recipe):                              # 2
            loss, grads = te_jax.train.value_and_grad(loss_fn)(state.params)  # 3: was jax.value_and_grad
        return state.apply_gradients(grads=grads), loss

(initialize the model under the same autocast so "fp8_meta" exists).
``grads["params"]`` are ordinary gradients; ``grads["fp8_meta"]`` is the
state update. Its amaxes are reduced across devices (``te_jax.ops.sharding``),
so it is identical on every device, and a ``lax.pmean`` over the whole
gradient tree keeps it identical; the mean of identical copies equals them
up to the rounding of XLA's all-reduce (it adds the copies one by one, so an
ulp or two can move). Do not scale or clip it: ``TrainState`` and
``apply_gradients`` give the optimizer the parameters only.

Quantization statistics (``te_jax.autocast(..., inspect=True)``, see
``te_jax.inspect``) travel the same way: the variables hold the
"fp8_stats" collection, its gradient is the statistics of the step
(``grads["fp8_stats"]``, uses of one layer merged by max), and
``apply_gradients`` leaves ``fp8_stats`` as it is.

Only these helpers may step FP8 state. The backward of a stateful layer
raises ``FP8StateError`` when traced outside ``value_and_grad``/``grad``
over variables holding "fp8_meta" (or outside ``fp8_state_updates()``, the
declaration for functional-API users; ``te_jax.core.gemm_quant``): ``jax.grad``
over all the variables would let an optimizer move the state like a
parameter, ``jax.grad`` over the parameters alone would leave it stale. The
gradients ``value_and_grad`` returns for such variables are a
``FP8Gradients``: flax's ``TrainState.apply_gradients`` raises
``FP8StateError`` on them, and handing them whole to an optax
``tx.update``/``optax.apply_updates`` built on a plain variables dict fails
with a pytree structure error (``FP8Gradients`` against ``dict``).

The update form. ``fp8_meta/<module path>/<role>`` holds one quantized
tensor's state, e.g. ``{"amax_history": f32[L], "scale": f32[1]}`` for
delayed scaling (stateless recipes create no entries; under ``nn.scan`` every
leaf gets the scanned axis). ``model.apply(variables, x,
mutable=["fp8_meta"])`` returns the forward-updated state (for inference and
calibration; a layer called several times in the apply merges its calls by
max, as training does); in training the state after forward *and* backward is the
gradient of ``fp8_meta``, in a form whose elementwise max merges two uses of
one state (a layer applied twice, micro-batches: ``merge_fp8_updates``), and
``apply_fp8_update`` turns it into the new state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT, fp32_max_grad
from flax.training import train_state
from jax import lax

from te_jax.core.forward_updates import CotangentMarks, record_forward_updates, warn_never_updated
from te_jax.core.gemm_quant import FP8StateError, fp8_state_updates
from te_jax.core.stats import STATS_COLLECTION
from te_jax.quantize import delayed
from te_jax.spec.names import FP8_COLLECTION
from te_jax.train import mix_check


__all__ = ["FP8Gradients", "FP8StateError", "TrainState", "accumulate_gradients", "apply_fp8_update", "apply_gradients",
           "fp8_state_updates", "grad", "merge_fp8_updates", "merge_gradients", "to_max_merging", "unused_update",
           "value_and_grad"]

# Collections whose gradient is not a gradient but a max-merged result: the fp8 state update, the statistics.
MAX_MERGED = (FP8_COLLECTION, STATS_COLLECTION)
# ... and flax's FP8 collection, whose gradient is its new value (te_jax.flax.DotGeneral keeps its state there).
STATE_COLLECTIONS = (*MAX_MERGED, OVERWRITE_WITH_GRADIENT)


def _has_fp8(tree: Any) -> bool:
    """Whether ``tree`` is a variables dict holding fp8_meta or fp8_stats."""
    return isinstance(tree, Mapping) and any(c in tree.keys() for c in MAX_MERGED)


def _has_state(tree: Any) -> bool:
    """Whether ``tree`` is a variables dict holding a collection no optimizer may see (``STATE_COLLECTIONS``)."""
    return isinstance(tree, Mapping) and any(c in tree.keys() for c in STATE_COLLECTIONS)


def _merged(tree: Mapping) -> list[str]:
    return [c for c in STATE_COLLECTIONS if c in tree.keys()]


def _gradients(tree: dict, like: Any) -> dict:
    """``tree`` as a ``FP8Gradients`` when ``like`` holds fp8_meta or fp8_stats, else a plain dict."""
    return FP8Gradients(tree) if _has_fp8(like) else dict(tree)


class FP8Gradients(dict):
    """The gradients of a variables dict holding "fp8_meta" or "fp8_stats" (a dict; a pytree of its own type).

    ``grads["params"]`` are gradients; ``grads["fp8_meta"]`` is the state
    update and ``grads["fp8_stats"]`` the statistics, neither of which an
    optimizer may see. Being a type of its own, the whole dict cannot be
    mapped against a plain variables dict (an optax update over all the
    variables fails), and flax's ``TrainState.apply_gradients``, which asks
    for its "_overwrite_with_gradient" entry, gets ``FP8StateError``. Gradients
    that a tree operation summed, averaged or scaled (``jax.tree.map(jnp.add,
    acc, g)``; ``te_jax.train.mix_check``) refuse to give their
    "fp8_meta"/"fp8_stats" and to be applied (``FP8StateError`` naming
    ``merge_gradients``).
    """

    def __getitem__(self, key):
        if key in MAX_MERGED and self.__dict__.get("_mixed", False):
            mix_check.verify(self.mix_check)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        if key == OVERWRITE_WITH_GRADIENT:
            raise FP8StateError(
                f"te_jax: these gradients carry the FP8 state update ({', '.join(map(repr, _merged(self)))}), "
                f"which flax's TrainState.apply_gradients would hand to the optimizer; step with "
                f"te_jax.train.TrainState (a drop-in for flax's, created with params=the whole variables dict) or "
                f"te_jax.train.apply_gradients")
        return super().__contains__(key)

    def __repr__(self) -> str:
        return f"FP8Gradients({dict.__repr__(self)})"

    @property
    def mix_check(self) -> Any:
        """The leaf that tree operations mixing gradients break (``te_jax.train.mix_check``)."""
        return self.__dict__.get("_mix_check", mix_check.zero())

    def with_mix_check(self, check: Any) -> FP8Gradients:
        """These gradients carrying ``check`` (returns self)."""
        self._mix_check = check
        return self


def _unflatten_gradients(keys, children) -> FP8Gradients:
    grads = FP8Gradients(zip(keys, children[:-1])).with_mix_check(children[-1])
    # Outside jit a tree operation that summed or scaled gradients is seen here; refused when the result is used
    # (a composite operation, e.g. lax.pmean's sum before its division, may pass through a mixed state).
    grads._mixed = not mix_check.consistent(children[-1])
    return grads


jax.tree_util.register_pytree_with_keys(
    FP8Gradients,
    lambda g: ((*((jax.tree_util.DictKey(k), dict.__getitem__(g, k)) for k in sorted(g)),
                (jax.tree_util.GetAttrKey("mix_check"), g.mix_check)), tuple(sorted(g))),
    _unflatten_gradients,
    lambda g: ((*(dict.__getitem__(g, k) for k in sorted(g)), g.mix_check), tuple(sorted(g))),
)


def _is_tracer(tree: Any) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


def value_and_grad(fun: Callable, argnums: int = 0, has_aux: bool = False) -> Callable:
    """``jax.value_and_grad`` whose differentiated argument may be a variables dict with "fp8_meta".

    The gradient of ``fp8_meta`` is its update for this step (apply it with
    ``te_jax.train.apply_fp8_update`` or ``TrainState.apply_gradients``), that
    of ``fp8_stats`` the step's quantization statistics; every other leaf gets
    its ordinary gradient. Uses of one state merge by max, not sum. A layer
    whose output gets no gradient (``jax.lax.stop_gradient``, a frozen
    encoder) still records its forward roles' update, taken from its forward
    pass (``te_jax.core.forward_updates``); one that te_jax cannot record
    there (inside ``nn.remat``, ``scan``, ``vmap`` or ``shard_map`` within
    ``fun``) and that gets no gradient is named in a warning. Called
    outside jit, the computation is jitted internally, so ``fun``'s outputs
    (and aux) must be arrays.

    With "fp8_meta" or "fp8_stats" in the differentiated variables the
    gradients are a ``FP8Gradients`` dict, and the differentiation runs
    inside ``fp8_state_updates()`` when "fp8_meta" is there. Stateful layers
    whose state is not in the differentiated argument raise ``FP8StateError``.
    flax's "_overwrite_with_gradient" collection (``te_jax.flax.DotGeneral``'s
    state) is differentiated in the max-merging dtype too: its gradient, the
    new value of the collection, merges the uses of a state by max (with it
    alone, the gradients are a plain dict, which flax's TrainState takes).
    """
    if not isinstance(argnums, int):
        raise ValueError(f"te_jax: value_and_grad differentiates one argument; argnums must be an int, got {argnums!r}")

    def wrapped(*args, **kwargs):
        variables = args[argnums]
        if not _has_state(variables):
            return jax.value_and_grad(fun, argnums, has_aux)(*args, **kwargs)

        def run(variables):
            v = {**variables, **{c: to_max_merging(variables[c]) for c in _merged(variables)}}
            recorded = [c for c in MAX_MERGED if c in v]
            traced = []  # what f's trace saw: the recorder and the cotangent marks (te_jax.core.forward_updates)

            def f(v):
                marks = CotangentMarks({c: v[c] for c in recorded})
                v = {**v, **marks.tree}
                # The forward roles' updates, for the layers whose backward never runs
                with record_forward_updates(marks.tree) as forward:
                    out = fun(*args[:argnums], v, *args[argnums + 1:], **kwargs)
                traced.append((forward, marks))
                out, aux = out if has_aux else (out, None)
                return out, (aux, forward.updates())

            out, vjp_fn, (aux, forward) = jax.vjp(f, v, has_aux=True)
            if jnp.shape(out) != () or not jnp.issubdtype(jnp.result_type(out), jnp.floating):
                raise TypeError(f"te_jax: value_and_grad needs a real scalar output, got {jnp.result_type(out)}"
                                f"{list(jnp.shape(out))}")
            (grads,) = vjp_fn(jnp.ones_like(out))
            warn_never_updated(*traced[-1], {c: v[c] for c in recorded}, FP8_COLLECTION)
            grads = {**grads, **{c: jax.tree.map(lambda g: lax.convert_element_type(g, jnp.float32), grads[c])
                                 for c in _merged(grads)}}
            # max with what the backward returned: the same forms where it ran, so only the others change
            grads = _gradients({**grads, **{c: jax.tree.map(jnp.maximum, grads[c], forward[c]) for c in recorded}},
                               variables)
            if isinstance(grads, FP8Gradients):
                grads.with_mix_check(mix_check.of([grads[c] for c in recorded]))
            return out, aux, grads

        # Max-merging cotangents only work traced; eager calls run jitted.
        with fp8_state_updates(FP8_COLLECTION in variables):
            out, aux, grads = run(variables) if _is_tracer(variables) else jax.jit(run)(variables)
        return ((out, aux) if has_aux else out), grads

    return wrapped


def grad(fun: Callable, argnums: int = 0, has_aux: bool = False) -> Callable:
    """``value_and_grad`` without the value (``(grads, aux)`` with ``has_aux``)."""
    vg = value_and_grad(fun, argnums, has_aux)

    def wrapped(*args, **kwargs):
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped


def merge_gradients(a: Any, b: Any) -> Any:
    """Gradients of two micro-batches: parameters summed, fp8 updates, statistics and overwrite-with-gradient
    values max-merged."""
    if not _has_state(a):
        return jax.tree.map(jnp.add, a, b)
    def one(k):
        return merge_fp8_updates(a[k], b[k]) if k in STATE_COLLECTIONS else jax.tree.map(jnp.add, a[k], b[k])

    merged = _gradients({k: one(k) for k in a}, a)
    if isinstance(merged, FP8Gradients):
        checks = [g.mix_check if isinstance(g, FP8Gradients) else mix_check.zero() for g in (a, b)]
        merged.with_mix_check(mix_check.merge(*checks))
    return merged


def accumulate_gradients(fun: Callable, variables: Any, micro_batches: Any, *, has_aux: bool = False,
                         average: bool = True):
    """Loss and gradients over micro-batches (a pytree with a leading micro-batch axis), by ``lax.scan``.

    ``fun(variables, micro_batch)`` returns the loss (and aux). Parameter
    gradients are summed (then divided by the number of micro-batches when
    ``average``, as is the loss); fp8 updates are max-merged, so the state
    takes one step whose amax is the largest over the micro-batches.

    Returns:
      ``(loss, grads)``, or ``((loss, stacked aux), grads)`` with ``has_aux``.
    """
    n = jax.tree.leaves(micro_batches)[0].shape[0]
    vg = value_and_grad(fun, has_aux=has_aux)

    def body(acc, batch):
        value, g = vg(variables, batch)
        loss, aux = value if has_aux else (value, None)
        return (acc[0] + loss, merge_gradients(acc[1], g)), aux

    zero = _map_trainable(lambda t: jax.tree.map(jnp.zeros_like, t), variables)
    if _has_state(variables):
        # "unused this step": the identity of the max-merge
        zero = _gradients({**zero, **{c: unused_update(variables[c]) for c in _merged(variables)}}, variables)
    (loss, grads), aux = lax.scan(body, (jnp.zeros((), jnp.float32), zero), micro_batches)
    if average:
        loss = loss / n
        grads = _map_trainable(lambda t: jax.tree.map(lambda g: g / n, t), grads)
    return ((loss, aux) if has_aux else loss), grads


def _trainable(tree: Any) -> Any:
    """What the optimizer sees: the variables without ``STATE_COLLECTIONS`` (just the params when that is all)."""
    if not _has_state(tree):
        return tree
    rest = {k: v for k, v in tree.items() if k not in STATE_COLLECTIONS}
    return rest["params"] if set(rest) == {"params"} else rest


def _with_trainable(tree: Any, trainable: Any) -> Any:
    if not _has_state(tree):
        return trainable
    rest = {k for k in tree if k not in STATE_COLLECTIONS}
    out = {**(trainable if rest != {"params"} else {"params": trainable}), **{c: tree[c] for c in _merged(tree)}}
    return FP8Gradients(out).with_mix_check(tree.mix_check) if isinstance(tree, FP8Gradients) else out


def _map_trainable(fn, tree):
    return _with_trainable(tree, fn(_trainable(tree)))


def apply_gradients(variables: Any, grads: Any, opt_state: Any, tx: optax.GradientTransformation):
    """One optimizer step on the parameters and the fp8 state update applied.

    "fp8_meta" takes its update (``apply_fp8_update``), "_overwrite_with_gradient"
    its gradient (its new value), "fp8_stats" stays as it is.

    Gradients that a tree operation summed, averaged or scaled
    (``te_jax.train.mix_check``) raise ``FP8StateError`` outside jit; inside
    jit their FP8 state comes out NaN.

    Returns:
      ``(new_variables, new_opt_state)``.
    """
    if isinstance(grads, FP8Gradients):
        mix_check.verify(grads.mix_check)
    missing = [c for c in (FP8_COLLECTION, OVERWRITE_WITH_GRADIENT)
               if c in variables.keys() and not (isinstance(grads, Mapping) and c in grads.keys())]
    if (_has_state(variables) and not _has_state(grads)) or missing:
        raise FP8StateError(f"te_jax: the variables hold {' and '.join(map(repr, _merged(variables)))} but the "
                            f"gradients do not{f' ({missing})' if missing else ''}; compute them with "
                            "te_jax.train.value_and_grad over the whole variables dict")
    updates, new_opt_state = tx.update(_trainable(grads), opt_state, _trainable(variables))
    new = _with_trainable(variables, optax.apply_updates(_trainable(variables), updates))
    if FP8_COLLECTION in new:
        new[FP8_COLLECTION] = apply_fp8_gradients(variables[FP8_COLLECTION], grads)
    if OVERWRITE_WITH_GRADIENT in new:
        new[OVERWRITE_WITH_GRADIENT] = jax.tree.map(lambda old, g: lax.convert_element_type(g, old.dtype),
                                                    variables[OVERWRITE_WITH_GRADIENT], grads[OVERWRITE_WITH_GRADIENT])
    return new, new_opt_state


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` whose ``params`` may be the whole variables dict.

    With ``params={"params": ..., "fp8_meta": ...}``, the optimizer sees only
    ``params["params"]`` and ``apply_gradients`` replaces fp8_meta by the
    state its gradient carries (an "fp8_stats" collection is kept as it is,
    "_overwrite_with_gradient" is overwritten with its gradient).
    Without either it is flax's TrainState (which overwrites flax's own FP8
    collection, "_overwrite_with_gradient", with its gradient).
    """

    @classmethod
    def create(cls, *, apply_fn, params, tx, **kwargs):
        if not _has_fp8(params):  # flax's, which also handles flax's own fp8 collection
            return super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
        return cls(step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=tx.init(_trainable(params)), **kwargs)

    def apply_gradients(self, *, grads, **kwargs):
        if not _has_fp8(self.params):
            return super().apply_gradients(grads=grads, **kwargs)
        params, opt_state = apply_gradients(self.params, grads, self.opt_state, self.tx)
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)


# ---- the update form: max-merge, apply ---------------------------------------------------


def _map_states(fn, *trees):
    """``fn`` on every delayed-scaling state (``delayed.is_state``: the stored dict layout of a ``DelayedState``)
    and every other leaf."""
    return jax.tree.map(fn, *trees, is_leaf=delayed.is_state)


def apply_fp8_update(fp8_meta: Any, update: Any) -> Any:
    """The new fp8_meta from the old one and its (merged) update, i.e. its gradient.

    Delayed-scaling states decode the update form (``te_jax.quantize.delayed``);
    any other leaf takes the update's value, except where it is -inf (unused
    this step), which keeps the old value.
    """

    def one(old, new):
        if delayed.is_state(old):
            return delayed.apply_state_gradient(old, new)
        new = jnp.asarray(new, jnp.float32) if new.dtype != jnp.float32 else new
        return jnp.where(new == -jnp.inf, old, new).astype(old.dtype)

    return _map_states(one, fp8_meta, update)


def apply_fp8_gradients(fp8_meta: Any, grads: Any) -> Any:
    """The new fp8_meta from the old one and the gradients holding its update, ``grads["fp8_meta"]``.

    ``apply_fp8_update``, checked: gradients that a tree operation mixed
    (``te_jax.train.mix_check``) raise ``FP8StateError`` outside jit and give
    a NaN state inside jit. Every step that applies an update goes through
    here (``apply_gradients``, ``te_jax.nnx.value_and_grad``), so that the
    Linen and NNX steps compile to the same computation and agree bit for bit.
    """
    check = grads.mix_check if isinstance(grads, FP8Gradients) else None
    if check is not None:
        mix_check.verify(check)
    new = apply_fp8_update(fp8_meta, grads[FP8_COLLECTION])
    if isinstance(check, jax.core.Tracer):
        new = mix_check.poisoned_unless_held(check, new)
    return new


def merge_fp8_updates(a: Any, b: Any) -> Any:
    """Two updates of the same state merged (elementwise max): one update with the larger amaxes."""
    return jax.tree.map(jnp.maximum, a, b)


def to_max_merging(fp8_meta: Any) -> Any:
    """The leaves as flax's ``fp32_max_grad`` dtype, whose cotangents add by max (use inside jit)."""
    return jax.tree.map(lambda v: lax.convert_element_type(jnp.asarray(v, jnp.float32), fp32_max_grad), fp8_meta)


def unused_update(fp8_meta: Any) -> Any:
    """The update meaning "not used this step" (all -inf): applying it keeps ``fp8_meta``."""
    return jax.tree.map(lambda v: jnp.full(jnp.shape(v), -jnp.inf, jnp.float32), fp8_meta)
