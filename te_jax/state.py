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

Flax layers use ``layer_quantizers``, ``layer_state`` and ``store_layer_state``::

    quantizers = layer_quantizers(self)                 # from the active autocast
    state = layer_state(self, quantizers)               # created by init, read by apply
    y, new_state = te_jax.dense(x, kernel, quantizers=quantizers, state=state, key=quantize_key(self, quantizers))
    store_layer_state(self, new_state)                  # kept when "fp8_meta" is mutable
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax.linen.fp8_ops import fp32_max_grad
from jax import lax

from te_jax import FP8_COLLECTION  # "fp8_meta", defined in te_jax/__init__.py
from te_jax.autocast import current
from te_jax.dense import DenseQuantizers
from te_jax.quantize import delayed
from te_jax.state_grad import missing_state_error

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


def layer_quantizers(module, recipe=None) -> DenseQuantizers:
    """The quantizers of a dense layer: ``recipe`` (default: the active autocast's) asked per role.

    Outside autocast (or with it disabled) every quantizer is None.
    """
    if recipe is None:
        config = current()
        recipe = config.recipe if config.enabled else None
    return DenseQuantizers.from_recipe(recipe, module_path(module))


def layer_state(module, quantizers: DenseQuantizers, prefix: str = "") -> dict[str, Any]:
    """The layer's state for its stateful quantizers, from ``fp8_meta`` (created when initializing).

    Args:
      module: the Flax module (call from its compact ``__call__``).
      quantizers: the layer's quantizers.
      prefix: prepended to the role in the variable name, for layers with
        several GEMMs (e.g. "wi_" + "linear_input").
    """
    out = {}
    for role, q in quantizers.stateful().items():
        name = prefix + role
        if not module.has_variable(FP8_COLLECTION, name) and not module.is_mutable_collection(FP8_COLLECTION):
            raise missing_state_error(f"layer {'/'.join(module_path(module)) or '<root>'}", name)
        out[role] = module.variable(FP8_COLLECTION, name, q.init_state).value
    return out


def store_layer_state(module, new_state: dict[str, Any] | None, prefix: str = "") -> None:
    """Writes the forward-updated state back when ``fp8_meta`` is mutable (not while initializing)."""
    if not new_state or module.is_initializing() or not module.is_mutable_collection(FP8_COLLECTION):
        return
    for role, value in new_state.items():
        module.put_variable(FP8_COLLECTION, prefix + role, value)


def quantize_key(module, quantizers: DenseQuantizers) -> jax.Array | None:
    """A key from the "quantize" RNG stream (``apply(..., rngs={"quantize": key})``), or None.

    Stochastic rounding needs it (a new key every step); without the stream
    the layer gets None and ``te_jax.dense`` says what is missing.
    """
    if quantizers.any and module.has_rng(QUANTIZE_RNG):
        return module.make_rng(QUANTIZE_RNG)
    return None
