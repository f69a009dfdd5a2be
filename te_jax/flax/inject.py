"""``te_jax.flax.DotGeneral``: te_jax's quantized GEMMs wherever flax.linen takes a ``dot_general_cls``.

::

    dense = nn.Dense(features, dot_general_cls=te_jax.flax.DotGeneral)
    attn = nn.MultiHeadDotProductAttention(num_heads, qkv_dot_general_cls=te_jax.flax.DotGeneral,
                                           out_dot_general_cls=te_jax.flax.DotGeneral)

flax.linen's ``Dense``, ``DenseGeneral`` and ``MultiHeadDotProductAttention``
build ``dot_general_cls()`` as a child module and call it as
``lax.dot_general``. Outside ``te_jax.autocast`` (or with it disabled) this
module *is* ``lax.dot_general``: the model's results are flax's, bit for bit,
and it creates no variables. Under ``te_jax.autocast(recipe=...)`` it runs
``te_jax.core.dot_general`` (rhs: the weight) with the recipe's quantizers,
asked with the *parent* layer's path (``("MultiHeadDotProductAttention_0",
"query")``), so ``CustomRecipe`` patterns and ``te_jax.inspect`` name the layer
that owns the kernel; NVFP4's stochastic rounding draws from the "quantize"
RNG stream, as te_jax.flax's layers do.

State. A delayed-scaling recipe keeps its state in flax's own FP8
collection, ``"_overwrite_with_gradient"`` (``te_jax.quantize.overwrite``: its
gradient *is* its new value), at ``_overwrite_with_gradient/<this module's
path>/<role>``, so flax's training loops keep it correct unchanged:
``flax.training.train_state.TrainState`` created with ``params=variables``
(the whole dict) and stepped with ``jax.grad`` over it, a plain optax loop that
writes ``variables["_overwrite_with_gradient"] = grads[...]``, and
``te_jax.train``'s ``value_and_grad`` / ``TrainState``. The module declares
``te_jax.train.fp8_state_updates()`` itself, around its forward.

It refuses at trace time (``te_jax.train.FP8StateError``) what would go wrong
silently: differentiating the weight but not the state (``jax.grad`` over
"params" only), and differentiating a state used twice in one apply (a layer
called twice) while the collection is float32, whose gradients of the uses add:
``te_jax.train.value_and_grad`` merges them by max, as does the collection in
``te_jax.train.to_max_merging``'s dtype. To find the second use, the module
reserves a name per use in the apply's root scope, as flax reserves a
submodule's name; uses in separate ``apply`` calls, or under separate lifted
transforms (``nn.remat`` blocks), are not seen: differentiate those with
``te_jax.train.value_and_grad``.

Statistics (``te_jax.autocast(..., inspect=True)``) are recorded in
"fp8_stats" as by te_jax.flax's layers (products without batch axes).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
from jax import lax

from te_jax.core import DenseQuantizers, split_stats, with_stats
from te_jax.core.dot_general import dot_general
from te_jax.core.gemm_quant import FP8StateError, fp8_state_updates
from te_jax.core.layer_support import located
from te_jax.flax import _common as C
from te_jax.quantize import overwrite

OVERWRITE_COLLECTION = overwrite.OVERWRITE_COLLECTION


class DotGeneral(nn.Module):
    """``lax.dot_general`` for flax.linen's ``dot_general_cls``, quantized under ``te_jax.autocast`` (module docs).

    Called as flax calls it: ``(lhs, rhs, dimension_numbers, precision=None,
    preferred_element_type=None)``; rhs is the weight. Batch axes (a
    ``DenseGeneral`` with ``batch_dims``) run on the grouped GEMM and keep one
    weight amax history per batch element (``te_jax.core.dot_general``).
    """

    @nn.compact
    def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision: Any = None,
                 preferred_element_type: Any = None) -> jax.Array:
        recipe = C.recipe_or_none()
        quantizers = DenseQuantizers.from_recipe(recipe, C.module_path(self)[:-1])
        if not quantizers.any:
            return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type)
        where = C.where(self)
        state, rhs = self._op_state(quantizers, rhs, dimension_numbers, where)
        stats = C.stats_input(self, quantizers)
        try:
            with fp8_state_updates():  # this module applies the update: its gradient is the new state
                y, new_state = dot_general(
                    lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type,
                    quantizers=quantizers, state=with_stats(state, stats), key=C.quantize_key(self, True),
                    inspect=C.inspect_arg(stats))
        except ValueError as err:
            if isinstance(err, FP8StateError):
                raise
            raise ValueError(str(located(err, where)).replace("te_jax: dot_general", f"te_jax: {where}", 1)) from None
        C.store_stats(self, split_stats(new_state)[1])
        return y

    def _op_state(self, quantizers: DenseQuantizers, rhs, dimension_numbers, where: str):
        """``(state for the op, rhs)``: the stored overwrite-form states read through ``overwrite.read``."""
        stateful = quantizers.stateful()
        if not stateful:
            return {}, rhs
        groups = batch_groups(rhs, dimension_numbers, where)
        initial = quantizers.init_state(num_groups=groups)
        return overwrite_state(self, quantizers, initial, rhs, where)


def batch_groups(rhs, dimension_numbers, where: str) -> int | None:
    """The number of batch elements of ``rhs`` under ``dimension_numbers`` (None: no batch axes)."""
    try:
        _, (_, rb) = dimension_numbers
        rb = (rb,) if isinstance(rb, int) else tuple(rb)
        groups = 1
        for axis in rb:
            groups *= rhs.shape[axis]
    except (TypeError, ValueError, IndexError):
        raise ValueError(f"te_jax: {where}: dimension_numbers must be ((lhs_contracting, rhs_contracting), "
                         f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}") from None
    return groups if rb else None


def overwrite_state(module: nn.Module, quantizers, initial: dict, watched: jax.Array, where: str,
                    name: str | None = None) -> tuple[dict, jax.Array]:
    """``(state for the op, watched)``: a Linen module's "_overwrite_with_gradient" state, read differentiably.

    Args:
      module: the Linen module whose scope holds the state (any module, compact or not).
      quantizers: the op's quantizers; their stateful roles are read.
      initial: ``{role: initial DelayedState}`` (shapes of the state to create when initializing).
      watched: the weight (``overwrite.read`` refuses differentiating it without the state).
      where: the module and op, for errors.
      name: None: one variable per role (``<path>/<role>``); else one variable ``name`` holding
        ``{role: state}`` (``<path>/<name>/<role>``), for several ops in one module.
    """
    scope = module.scope
    stateful = quantizers.stateful()
    names = list(stateful) if name is None else [name]
    for n in names:
        if not scope.has_variable(OVERWRITE_COLLECTION, n) and not scope.is_mutable_collection(OVERWRITE_COLLECTION):
            raise ValueError(
                f"te_jax: {where} has no {OVERWRITE_COLLECTION} state {n!r}, which this recipe keeps: "
                f"initialize the model under te_jax.autocast with it and apply the whole variables dict that "
                f"init returns")
    if name is None:
        stored = {r: scope.variable(OVERWRITE_COLLECTION, r, overwrite.init_like, initial[r]).value for r in stateful}
    else:
        value = scope.variable(OVERWRITE_COLLECTION, name,
                               lambda: {r: overwrite.init_like(initial[r]) for r in stateful}).value
        missing = [r for r in stateful if r not in value]
        if missing:
            raise ValueError(f"te_jax: {where}: {OVERWRITE_COLLECTION} state {name!r} lacks {missing}; "
                             "re-initialize the model under this recipe")
        stored = {r: value[r] for r in stateful}
    return overwrite.read(stored, watched, shared=_used_before(scope, name), where=where, error=FP8StateError)


def _used_before(scope, name: str | None) -> bool:
    """Whether this state already ran in this apply: a name reserved per use in the root scope."""
    root = scope.root
    key = "te_jax.overwrite:" + "/".join(scope.path) + ("" if name is None else "/" + name)
    if root.name_reserved(key, OVERWRITE_COLLECTION):
        return True
    root.reserve(key, OVERWRITE_COLLECTION)
    return False
