"""Training an NNX model with FP8 state: the gradient step that also applies the state update.

::

    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)   # never sees FP8Meta

    @nnx.jit
    def train_step(model, optimizer, x, y):
        with te_jax.autocast(recipe=recipe):
            loss, grads = te_jax.nnx.value_and_grad(loss_fn)(model, x, y)   # was nnx.value_and_grad
        optimizer.update(model, grads)
        return loss

``value_and_grad`` differentiates ``loss_fn(model, ...)`` with respect to
the model's ``nnx.Param`` variables and returns their gradients; the
gradient of the ``FP8Meta`` variables, which is their state after forward
and backward (``te_jax.train``, ``te_jax.train.step``), is applied to the model
in place, as are the step's statistics to ``FP8Stats`` and any other
variable the call changed (e.g. RNG counts). A layer called several times
in one step records one update per call; they merge by max. A layer whose
output gets no gradient (``jax.lax.stop_gradient``, a frozen encoder) still
records its forward roles' update (``te_jax.core.forward_updates``).

Calling a model reads its FP8 state and never writes it, so a forward-only
pass (evaluation, a teacher called outside ``value_and_grad``) leaves the
state as it is: ``calibrate(fun)(model, ...)`` runs ``fun`` and applies the
forward update of every te_jax layer it calls (the NNX counterpart of a
Linen ``apply(..., mutable=["fp8_meta"])``).

``nnx.value_and_grad`` / ``nnx.grad`` over a model with delayed-scaling
state raise ``te_jax.train.FP8StateError`` when traced: they would drop the
update (``te_jax.core.gemm_quant``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from te_jax import train as linen_train
from te_jax.core.forward_updates import record_forward_updates
from te_jax.core.stats import STATS_COLLECTION
from te_jax.nnx.paths import name_paths
from te_jax.nnx.variables import FP8Meta, FP8Stats
from te_jax.train.step import FP8_COLLECTION, apply_fp8_gradients, apply_fp8_update

_OTHER = nnx.Not(nnx.Any(nnx.Param, FP8Meta, FP8Stats))


def value_and_grad(fun: Callable, *, has_aux: bool = False) -> Callable:
    """``nnx.value_and_grad(fun)`` (parameters only) that also steps the model's FP8 state.

    Args:
      fun: ``fun(model, *args, **kwargs)`` returning a real scalar loss
        (``(loss, aux)`` with ``has_aux``).
      has_aux: whether ``fun`` returns auxiliary data.

    Returns:
      ``f(model, *args, **kwargs) -> (loss, grads)`` (``((loss, aux), grads)``
      with ``has_aux``): ``grads`` is an ``nnx.State`` of the ``nnx.Param``
      gradients, for ``nnx.Optimizer(model, tx, wrt=nnx.Param).update``. The
      model's ``FP8Meta`` holds the state after this step's forward and
      backward on return, its ``FP8Stats`` this step's statistics. Outside
      ``nnx.jit`` the differentiation is jitted (outputs must be arrays).
      Each te_jax layer built without ``path=`` is first named by its path
      in ``model`` (``te_jax.nnx.name_paths``).
    """

    def wrapped(model: nnx.Module, *args, **kwargs):
        name_paths(model)  # per-layer recipes and the statistics need each te_jax layer's path
        graphdef, params, fp8_meta, fp8_stats, other = nnx.split(model, nnx.Param, FP8Meta, FP8Stats, ...)
        variables = {"params": params}
        if fp8_meta:
            variables[FP8_COLLECTION] = fp8_meta
        if fp8_stats:
            variables[STATS_COLLECTION] = fp8_stats

        def loss_fn(variables, other):
            states = (variables["params"], variables.get(FP8_COLLECTION, fp8_meta),
                      variables.get(STATS_COLLECTION, fp8_stats), other)
            # Fresh Variable objects: those of this trace may be updated (RNG counts), the caller's not.
            m = nnx.merge(graphdef, *jax.tree.map(lambda a: a, states))
            out = fun(m, *args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, nnx.state(m, _OTHER))

        (loss, (aux, new_other)), grads = linen_train.value_and_grad(loss_fn, has_aux=True)(variables, other)
        if fp8_meta:
            nnx.update(model, apply_fp8_gradients(fp8_meta, grads))
        if fp8_stats:
            nnx.update(model, grads[STATS_COLLECTION])
        nnx.update(model, new_other)
        return ((loss, aux) if has_aux else loss), grads["params"]

    return wrapped


def calibrate(fun: Callable) -> Callable:
    """``fun(model, *args, **kwargs)`` that also applies the forward pass's FP8 state update to ``model``.

    Each te_jax layer ``fun`` calls records the update of its forward roles
    (input, weight, output: this pass's amax into the history, the scale from
    it), a layer called several times merges its calls by max as training
    does, and the model's ``FP8Meta`` holds the result on return; the
    backward-only role (grad_output) keeps its state. Works eagerly and under
    ``nnx.jit``; a layer inside ``nnx.remat``, ``nnx.scan`` or ``nnx.vmap``
    within ``fun`` runs in another trace and records nothing.

    Returns:
      ``f(model, *args, **kwargs)``, returning what ``fun`` returns.
    """

    def wrapped(model: nnx.Module, *args, **kwargs):
        name_paths(model)
        fp8_meta = nnx.state(model, FP8Meta)
        if not fp8_meta:
            return fun(model, *args, **kwargs)
        with record_forward_updates(fp8_meta) as forward:
            out = fun(model, *args, **kwargs)
        nnx.update(model, apply_fp8_update(fp8_meta, forward.updates()))
        return out

    return wrapped


def grad(fun: Callable, *, has_aux: bool = False) -> Callable:
    """``value_and_grad`` without the value: ``grads`` (``(grads, aux)`` with ``has_aux``)."""
    vg = value_and_grad(fun, has_aux=has_aux)

    def wrapped(model: nnx.Module, *args, **kwargs):
        value, grads = vg(model, *args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped
