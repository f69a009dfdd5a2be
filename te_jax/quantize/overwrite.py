"""Delayed-scaling state in flax's overwrite-with-gradient form ("_overwrite_with_gradient").

flax's convention for FP8 meta variables: the gradient of a variable in the
collection ``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT`` *is* its new value
(flax's ``TrainState.apply_gradients`` and MaxText overwrite the variable with
it; a plain optax loop does ``variables[OWG] = grads[OWG]``), and several uses
of one variable in a step merge by elementwise max when the collection is in
flax's ``fp32_max_grad`` dtype (``te_jax.train.to_max_merging``;
``te_jax.train.value_and_grad`` converts it). This module stores one tensor's
delayed-scaling state so that both hold exactly.

The stored form (``OverwriteState``; what the collection holds, per role)::

    {"amax_history": f32[L], "scale_update": f32[1], "scale": f32[1]}

* ``amax_history``: the amax history after the step, exactly
  ``te_jax.quantize.delayed``'s (two uses' histories differ only in the
  newest entry, so their max is the history of the larger amax);
* ``scale_update``: the step's ``StateUpdate.scale``: the new scale negated
  (so max picks the smaller scale, that of the larger amax),
  ``KEEP_ZERO_AMAX`` (-inf: the amax was 0, loses every merge) or
  ``KEEP_NONFINITE_AMAX`` (+inf: not finite, wins every merge);
* ``scale``: the scale the step quantized with, identical for every use of
  a step (so unchanged by the max), taken where ``scale_update`` keeps the
  old scale.

The scale the next step quantizes with (``to_delayed``) is
``decode_update`` of it: ``-scale_update`` when finite, else ``scale``. So
after each step the decoded history and scale are exactly those of
``te_jax.flax.DenseGeneral``'s "fp8_meta" under the same recipe, and the max
of two uses' stored values decodes to ``te_jax.train.merge_fp8_updates`` of
their updates. Why not the decode scale ``1/scale`` (which also grows with the
amax): ``1/(1/s)`` is not ``s`` in float32 for about one scale in eight, and
the quantized values would differ from the fp8_meta layers'.

All zeros (and all -inf, the max-merge's zero) decode to the initial state
(zero history, scale 1; ``scale`` <= 0 means "the initial scale"). That is the
initial value, and what a step leaves when the module's output does not reach
the loss: flax's convention then writes the zero gradient as the state, and
the state restarts its calibration.

``read`` converts the stored value to the ``DelayedState`` a core op takes
through a custom VJP whose backward turns the op's state cotangent (the update
form) into the new stored value. Its forward also refuses, at trace time, the
two ways the convention silently fails (``FP8StateError``): the state is not
differentiated while the weight is (``jax.grad`` over "params" only leaves the
state stale), and a state used twice in a step is in float32 (the cotangents of
the uses would add, not merge).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from te_jax.quantize.delayed import KEEP_ZERO_AMAX, DelayedState, StateUpdate, decode_update

__all__ = ["FIELDS", "OVERWRITE_COLLECTION", "OverwriteState", "adds_cotangents", "from_update", "init_like",
           "init_state", "is_state", "read", "to_delayed"]

OVERWRITE_COLLECTION = "_overwrite_with_gradient"  # flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT
FIELDS = ("amax_history", "scale_update", "scale")


class OverwriteState(NamedTuple):
    """One tensor's stored state (module docstring); leaves ``f32[..., L]``, ``f32[..., 1]``, ``f32[..., 1]``."""

    amax_history: jax.Array
    scale_update: jax.Array
    scale: jax.Array

    @classmethod
    def of(cls, stored: Any) -> OverwriteState:
        """The typed view of the stored dict (leaves as float32; a max-merging dtype is converted)."""
        get = stored.__getitem__ if isinstance(stored, Mapping) else lambda f: getattr(stored, f)
        return cls(*(_f32(get(f)) for f in FIELDS))


def _f32(v: jax.Array) -> jax.Array:
    return v if v.dtype == jnp.float32 else lax.convert_element_type(v, jnp.float32)


def is_state(tree: Any) -> bool:
    """Whether ``tree`` is a stored overwrite-form state (the dict layout or an ``OverwriteState``)."""
    return isinstance(tree, OverwriteState) or (isinstance(tree, Mapping) and set(tree) == set(FIELDS))


def init_state(amax_history_len: int = 1024) -> dict[str, jax.Array]:
    """The initial stored state: all zeros (decodes to a zero history and scale 1)."""
    return init_like(DelayedState(jnp.zeros((amax_history_len,), jnp.float32), jnp.ones((1,), jnp.float32)))


def init_like(state: Any) -> dict[str, jax.Array]:
    """The initial stored state with the shapes of the delayed-scaling state ``state`` (leading axes kept)."""
    view = DelayedState.of(state)
    return OverwriteState(jnp.zeros(view.amax_history.shape, jnp.float32), jnp.zeros(view.scale.shape, jnp.float32),
                          jnp.zeros(view.scale.shape, jnp.float32))._asdict()


def to_delayed(stored: Any) -> DelayedState:
    """The delayed-scaling state the next step quantizes with (``decode_update`` of the stored update).

    ``scale_update`` 0 (never written by a step: the initial or a zeroed state)
    keeps ``scale``, and ``scale`` <= 0 is the initial scale 1; -inf history
    entries (the max-merge's zero) read as 0.
    """
    s = OverwriteState.of(stored)
    kept = jnp.where(s.scale > 0, s.scale, jnp.ones_like(s.scale))
    update = StateUpdate(s.amax_history, jnp.where(s.scale_update == 0, jnp.float32(KEEP_ZERO_AMAX), s.scale_update))
    return decode_update(DelayedState(jnp.zeros_like(s.amax_history), kept), update)


def from_update(old: DelayedState, update: StateUpdate) -> OverwriteState:
    """The stored state after a step: ``update`` (the op's state cotangent) over the state ``old`` it quantized with."""
    new = decode_update(old, update)
    return OverwriteState(new.amax_history, update.scale, old.scale)


def adds_cotangents(dtype) -> bool:
    """Whether two uses' cotangents of a leaf of ``dtype`` add (float types) instead of merging by max.

    flax's ``fp32_max_grad`` (``te_jax.train.to_max_merging``) is a JAX extended dtype whose cotangents merge by
    max; every plain floating dtype adds.
    """
    return jnp.issubdtype(dtype, jnp.floating)


def read(stored: Mapping[str, Any], watched: jax.Array, *, shared: bool, where: str,
         error: Callable[[str], Exception]) -> tuple[dict[str, dict[str, jax.Array]], jax.Array]:
    """``({role: DelayedState dict}, watched)``: the stored states as a core op takes them, differentiably.

    Args:
      stored: ``{role: stored state}`` (float32 or a max-merging dtype).
      watched: an array passed through unchanged (the weight), whose
        differentiation without the state's is refused.
      shared: the state is used more than once in this apply.
      where: the module, for the errors.
      error: the exception type of the refusals (``te_jax.core.gemm_quant.FP8StateError``).

    The backward returns, as the cotangent of each stored state, its new
    value (``from_update`` of the op's state cotangent over the state it
    read), in the stored dtype; a role the op left without a cotangent gets a
    zero one.
    """
    roles = tuple(sorted(stored))
    dtypes = {r: {f: stored[r][f].dtype for f in FIELDS} for r in roles}

    def primal(stored, watched):
        return {r: to_delayed(stored[r])._asdict() for r in roles}, watched

    def fwd(stored, watched):
        state_perturbed = any(leaf.perturbed for leaf in jax.tree.leaves(stored))
        values = jax.tree.map(lambda leaf: leaf.value, stored)
        if watched.perturbed and not state_perturbed:
            raise error(
                f"te_jax: {where}: the weight is differentiated but its FP8 state ({OVERWRITE_COLLECTION!r}, roles "
                f"{list(roles)}) is not, so the state would stay stale: its gradient is its new value. "
                f"Differentiate the whole variables dict (flax's TrainState with params=variables, or "
                f"te_jax.train.value_and_grad) and write variables[{OVERWRITE_COLLECTION!r}] = "
                f"grads[{OVERWRITE_COLLECTION!r}] after each step")
        if state_perturbed and shared and any(adds_cotangents(d) for r in roles for d in dtypes[r].values()):
            raise error(
                f"te_jax: {where} is called more than once in this apply, and its FP8 state "
                f"({OVERWRITE_COLLECTION!r}) is float32, whose gradients of several uses ADD instead of merging "
                f"into the new state. Differentiate with te_jax.train.value_and_grad (which merges them by max), "
                f"or convert the collection first: variables = {{**variables, {OVERWRITE_COLLECTION!r}: "
                f"te_jax.train.to_max_merging(variables[{OVERWRITE_COLLECTION!r}])}} inside the jitted step "
                f"(and the gradient back to float32), or give each use its own module")
        states = {r: to_delayed(values[r]) for r in roles}
        return ({r: states[r]._asdict() for r in roles}, watched.value), states

    def bwd(states, cotangents):
        ct_states, ct_watched = cotangents
        out = {}
        for r in roles:
            ct = ct_states[r]
            if any(isinstance(v, SymbolicZero) for v in ct.values()):
                out[r] = {f: None for f in FIELDS}
                continue
            new = from_update(states[r], StateUpdate.of(ct))._asdict()
            out[r] = {f: lax.convert_element_type(new[f], dtypes[r][f]) for f in FIELDS}
        return out, (None if isinstance(ct_watched, SymbolicZero) else ct_watched)

    op = jax.custom_vjp(primal)
    op.defvjp(fwd, bwd, symbolic_zeros=True)
    return op({r: dict(stored[r]) for r in roles}, watched)
