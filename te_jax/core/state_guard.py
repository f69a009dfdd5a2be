"""Who may differentiate through FP8 state: the guard that keeps an optimizer off it.

A layer with delayed scaling returns its state after forward and backward as
the *gradient* of that state (``te_jax.train`` explains why). Only a caller
that knows this may take that gradient: ``jax.grad`` over all the variables
followed by an optimizer step (flax's ``TrainState``, ``optax.apply_updates``)
would move the state like a parameter, and ``jax.grad`` over the parameters
alone would drop the update and leave the state stale. Both are silent, so
the backward of every stateful layer asks, when it is traced, whether the
caller declared that it applies the state update (``fp8_state_updates``), and
raises ``FP8StateError`` otherwise.

``te_jax.train.value_and_grad`` and ``te_jax.train.grad`` declare it when
the differentiated variables hold "fp8_meta" (``te_jax.nnx.value_and_grad``
builds on them). Functional-API users who
differentiate ``te_jax.dense(..., state=...)`` themselves declare it::

    with te_jax.train.fp8_state_updates():
        dx, dstate = jax.grad(loss, argnums=(0, 1))(x, state)
    state = te_jax.train.update.apply_fp8_update(state, dstate)

(pass ``te_jax.train.update.to_max_merging(state)`` when one state is used more than
once in the function, so that its updates merge by max.) The declaration is
read at trace time and is part of jit's cache key, like ``te_jax.autocast``.
"""

from __future__ import annotations

import jax

_applies_updates = jax.make_user_context(default_value=False)

FIX = (
    "differentiate with te_jax.train.value_and_grad (or te_jax.train.grad) over the whole variables dict, "
    "\"fp8_meta\" included, and step with te_jax.train.TrainState (or te_jax.train.apply_gradients), "
    "not with jax.grad / jax.value_and_grad, flax.training.train_state.TrainState or optax.apply_updates. "
    "A te_jax.nnx model: differentiate with te_jax.nnx.value_and_grad (or te_jax.nnx.grad), which applies the "
    "update. Calling te_jax.dense / layernorm_dense / layernorm_mlp with state=... directly: differentiate inside "
    "`with te_jax.train.fp8_state_updates():` and apply the state's gradient with te_jax.train.update.apply_fp8_update"
)


class FP8StateError(ValueError):
    """A step would corrupt FP8 state or leave it stale."""


def fp8_state_updates(enabled: bool = True):
    """Context manager: the caller applies the FP8 state updates that differentiation returns.

    Inside it, stateful layers may be differentiated; the gradient of their
    state is its update, to apply with ``te_jax.train.update.apply_fp8_update``,
    never to hand to an optimizer. ``enabled=False`` withdraws the
    declaration for its body.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"te_jax: fp8_state_updates(enabled=...) must be True or False, got {enabled!r}")
    return _applies_updates(enabled)


def applies_fp8_state_updates() -> bool:
    """Whether the innermost ``fp8_state_updates`` declares that the caller applies state updates."""
    return _applies_updates.value


def check_state_update_applied(roles) -> None:
    """Raises ``FP8StateError`` unless the caller applies state updates; a no-op when ``roles`` is empty.

    Called by the backward rule of every layer, at trace time, with the roles
    whose state it returns an update for.
    """
    if roles and not applies_fp8_state_updates():
        raise FP8StateError(
            f"te_jax: this model keeps FP8 state (delayed scaling: the \"fp8_meta\" collection, here for "
            f"{sorted(set(roles))}), and its update after each step comes back as the gradient of that state; "
            f"an optimizer would change it like a parameter, and dropping it leaves the scales stale. To train, "
            f"{FIX}."
        )


def missing_state_error(layer: str, name: str) -> ValueError:
    """The error of a layer applied without the "fp8_meta" entry ``name`` that its recipe keeps."""
    return ValueError(
        f"te_jax: {layer} has no fp8_meta state {name!r}, which this recipe keeps: initialize the model "
        f"under te_jax.autocast with it and apply the whole variables dict that init returns; to train, {FIX}")
