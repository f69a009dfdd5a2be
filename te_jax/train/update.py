"""FP8 state in the Flax collection "fp8_meta": creating, reading, updating and merging it.

Layout: ``fp8_meta/<module path>/<role>`` holds the state of one quantized
tensor, e.g. ``fp8_meta["TransformerLayer_0"]["mlp"]["wi"]["linear_input"] ==
{"amax_history": f32[L], "scale": f32[1]}`` for delayed scaling. Stateless
recipes create no entries. Under ``nn.scan`` every leaf gets the scanned axis.

How state moves (one mechanism, see ``te_jax.train``):

* ``model.apply(variables, x, mutable=["fp8_meta"])`` returns the
  forward-updated state (the amaxes of inputs, weights and outputs): for
  inference and calibration.
* In training, the state after forward *and* backward (the gradients' amaxes
  are only known in backward) is the gradient of ``variables["fp8_meta"]``:
  ``te_jax.train.value_and_grad`` computes it in a max-merging form, and
  ``apply_fp8_update`` (or ``te_jax.train.TrainState.apply_gradients``)
  turns it into the new state. Uses of one state in a step (a layer applied
  twice, micro-batches) merge by elementwise max (``merge_fp8_updates``).

The te_jax.flax layers create and read their entries when they are called
(``te_jax.flax._common.gemm_state`` / ``store_gemm_state``): a layer with one
GEMM keeps ``fp8_meta/<path>/<role>``, ``LayerNormMLP`` one entry per GEMM,
``fp8_meta/<path>/wi/<role>`` and ``.../wo/<role>``. Their stochastic-rounding
keys come from the RNG stream ``QUANTIZE_RNG`` (``apply(..., rngs={"quantize": key})``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax.linen.fp8_ops import fp32_max_grad
from jax import lax

from te_jax import FP8_COLLECTION  # "fp8_meta", defined in te_jax/__init__.py
from te_jax.quantize import delayed

__all__ = ["FP8_COLLECTION", "QUANTIZE_RNG", "apply_fp8_update", "merge_fp8_updates", "module_path", "to_max_merging",
           "unused_update"]

QUANTIZE_RNG = "quantize"


# ---- the update form: max-merge, apply ---------------------------------------------------


def _map_states(fn, *trees):
    """``fn`` on every delayed-scaling state (dicts {"amax_history", "scale"}) and every other leaf."""
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


def merge_fp8_updates(a: Any, b: Any) -> Any:
    """Two updates of the same state merged (elementwise max): one update with the larger amaxes."""
    return jax.tree.map(jnp.maximum, a, b)


def to_max_merging(fp8_meta: Any) -> Any:
    """The leaves as flax's ``fp32_max_grad`` dtype, whose cotangents add by max (use inside jit)."""
    return jax.tree.map(lambda v: lax.convert_element_type(jnp.asarray(v, jnp.float32), fp32_max_grad), fp8_meta)


def unused_update(fp8_meta: Any) -> Any:
    """The update meaning "not used this step" (all -inf): applying it keeps ``fp8_meta``."""
    return jax.tree.map(lambda v: jnp.full(jnp.shape(v), -jnp.inf, jnp.float32), fp8_meta)


# ---- Flax layers -------------------------------------------------------------------------


def module_path(module) -> tuple[str, ...]:
    """A Flax module's path (its scope's names), e.g. ``("TransformerLayer_0", "mlp", "wi")``."""
    scope = getattr(module, "scope", None)
    return tuple(getattr(scope, "path", ()) or ())
