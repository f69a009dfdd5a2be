"""te_jax's Qwix provider: an unmodified Linen or NNX model's products on te_jax's FP8 kernels.

::

    provider = te_jax.qwix.Provider([
        te_jax.qwix.Rule(module_path=r".*embed.*", quantize=False),      # first match wins
        te_jax.qwix.Rule(module_path=r".*mlp.*", recipe=te_jax.recipe.Float8BlockScaling()),
        te_jax.qwix.Rule(module_path=r".*"),                             # the autocast's recipe
    ])
    model = qwix.quantize_model(model, provider)                        # Linen
    with te_jax.autocast(recipe=te_jax.recipe.DelayedScaling()):
        variables = model.init(key, x)                                   # the state is created here
        model = qwix.quantize_model(nnx_model, provider, x)              # NNX: under the autocast too

Qwix intercepts ``jax.lax.dot_general``, ``jax.numpy.einsum`` and
``jax.lax.ragged_dot`` inside the model's methods and asks the provider,
with the calling module's path, which rule applies. A product is quantized
only under an enabled ``te_jax.autocast``, when a rule matches with
``quantize=True`` and one operand is a parameter of the calling module (the
weight: a projection's kernel, an MoE's experts; products of two
activations, such as attention scores, stay as they are). Its recipe is
the rule's ``recipe``, or the autocast's when the rule has none; the recipe's
roles carry the module's path, so a ``CustomRecipe`` can choose further.
Everything else is the intercepted jax function called as it was: outside
autocast the model computes what it computes without Qwix, bit for bit.

The computation is te_jax's injected products: ``te_jax.core.dot_general``,
``te_jax.core.einsum`` and ``te_jax.ragged_dot`` on the fused kernels.
State (delayed scaling) is kept as te_jax's injected modules keep it: in a
Linen module's "_overwrite_with_gradient" collection, one entry per product
(``_overwrite_with_gradient/<module path>/<op id>/<role>``, e.g.
``.../Dense_0/dot_general0/linear_input``), so flax's TrainState, a plain
optax loop or ``te_jax.train`` step it; in an NNX module, a
``te_jax.nnx.DotGeneral`` / ``EinsumOp`` / ``RaggedDot`` child per product
(``te_jax_dot_general0``, ...), created at Qwix's first run and stepped by
``te_jax.nnx.value_and_grad``. NVFP4's stochastic rounding draws its key from
the "quantize" RNG stream (Linen) or the NNX child's ``rngs``.

Limits: quantization statistics (``inspect=True``) are not recorded for
intercepted products (a clear error); ``ragged_dot``'s ``group_offset`` is
refused as ``te_jax.ragged_dot`` refuses it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from jax import lax
from qwix._src.utils import flax_util

from te_jax import nnx as te_nnx
from te_jax.core import DenseQuantizers
from te_jax.core.dot_general import dot_general as core_dot_general
from te_jax.core.dot_general import einsum as core_einsum
from te_jax.core.dot_general import parse_einsum
from te_jax.core.gemm_quant import FP8StateError, fp8_state_updates
from te_jax.flax._common import quantize_key
from te_jax.flax.inject import batch_groups, overwrite_state
from te_jax.flax.ragged import ragged_dot_call
from te_jax.recipe import Recipe
from te_jax.recipe.autocast import autocast, current_recipe, inspecting

__all__ = ["Provider", "Rule"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule(qwix.QuantizationRule):
    """A Qwix rule choosing te_jax's quantization for the products of the modules it matches.

    Attributes:
      module_path: regex over the module path (``"block_0/mlp/Dense_0"``), as Qwix matches it.
      op_names: the intercepted ops it applies to (``"dot_general"``, ``"einsum"``, ``"ragged_dot"``); () for all.
      recipe: the te_jax recipe for matched products; None: the active ``te_jax.autocast``'s.
      quantize: False leaves matched products in high precision (for exclusions before a catch-all rule).
    """

    recipe: Recipe | None = None
    quantize: bool = True

    def __post_init__(self):
        if self.recipe is not None and not isinstance(self.recipe, Recipe):
            raise ValueError(f"te_jax: qwix.Rule.recipe must be a te_jax.recipe.Recipe or None, got {self.recipe!r}")
        if self.weight_qtype is not None or self.act_qtype is not None:
            raise ValueError("te_jax: qwix.Rule takes a te_jax recipe (recipe=...), not Qwix's weight_qtype / "
                             "act_qtype; use qwix.QtProvider for Qwix's own quantization")


class Provider(qwix.QuantizationProvider):
    """Routes the intercepted ``dot_general`` / ``einsum`` / ``ragged_dot`` of matched modules to te_jax.

    Args:
      rules: ``te_jax.qwix.Rule``s in order of precedence (the first match wins).
    """

    def __init__(self, rules: Sequence[Rule], **kwargs):
        for rule in rules:
            if not isinstance(rule, Rule):
                raise ValueError(f"te_jax: qwix.Provider takes te_jax.qwix.Rule rules, got {type(rule).__name__}")
        super().__init__(rules, **kwargs)

    def get_intercept_map(self):
        return super().get_intercept_map() | {
            "jax.lax.dot_general": self.dot_general,
            "jax.numpy.einsum": self.einsum,
            "jax.lax.ragged_dot": self.ragged_dot,
        }

    def _recipe(self, op_name: str) -> tuple[Recipe | None, str | None]:
        """``(recipe, op id)`` for the current product; the recipe is None when it stays unquantized."""
        rule, op_id = self._get_current_rule_and_op_id(op_name)
        if rule is None or not rule.quantize or current_recipe() is None:
            return None, op_id
        return (rule.recipe or current_recipe()), op_id

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                    out_sharding=None):
        """``jax.lax.dot_general``; a matched product with a parameter operand quantized by te_jax."""
        recipe, op_id = self._recipe("dot_general")
        flax_op = functools.partial(lax.dot_general, lhs, rhs, dimension_numbers, precision=precision,
                                    preferred_element_type=preferred_element_type, out_sharding=out_sharding)
        if recipe is None:
            return flax_op()
        weight = _weight_operand(lhs, rhs)
        if weight is None:
            return flax_op()
        if weight == 0:  # the weight on the left: the product with the operands swapped, its output axes moved back
            (lc, rc), (lb, rb) = dimension_numbers
            y = self._dot_general(recipe, op_id, rhs, lhs, ((rc, lc), (rb, lb)), precision, preferred_element_type)
            nb = len(_axes(lb))
            n_rhs_free = rhs.ndim - nb - len(_axes(rc))
            n_lhs_free = lhs.ndim - nb - len(_axes(lc))
            perm = (tuple(range(nb)) + tuple(range(nb + n_rhs_free, nb + n_rhs_free + n_lhs_free))
                    + tuple(range(nb, nb + n_rhs_free)))
            y = jnp.transpose(y, perm)
        else:
            y = self._dot_general(recipe, op_id, lhs, rhs, dimension_numbers, precision, preferred_element_type)
        return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)

    def _dot_general(self, recipe, op_id, lhs, rhs, dimension_numbers, precision, preferred_element_type):
        module = flax_util.get_current_module()
        with autocast(recipe=recipe):
            if isinstance(module, nnx.Module):
                child = _nnx_child(module, op_id, lambda path: te_nnx.DotGeneral(
                    batch_size=batch_groups(rhs, dimension_numbers, op_id), path=path))
                return child(lhs, rhs, dimension_numbers, precision, preferred_element_type)
            run = functools.partial(core_dot_general, lhs, dimension_numbers=dimension_numbers, precision=precision,
                                    preferred_element_type=preferred_element_type)
            return _linen_product(module, op_id, rhs, batch_groups(rhs, dimension_numbers, op_id),
                                  lambda q, state, w, key: run(w, quantizers=q, state=state, key=key))

    def einsum(self, einsum_str, *operands, precision=None, preferred_element_type=None,
               _dot_general=lax.dot_general, out_sharding=None):  # noqa: N803 (jnp.einsum's keyword)
        """``jax.numpy.einsum``; a matched two-operand product with a parameter operand quantized by te_jax."""
        recipe, op_id = self._recipe("einsum")
        flax_op = functools.partial(jnp.einsum, einsum_str, *operands, precision=precision,
                                    preferred_element_type=preferred_element_type, _dot_general=_dot_general,
                                    out_sharding=out_sharding)
        if recipe is None or len(operands) != 2 or not isinstance(einsum_str, str):
            return flax_op()
        weight = _weight_operand(*operands)
        if weight is None:
            return flax_op()
        lhs, rhs = operands
        equation = einsum_str.replace(" ", "")
        if weight == 0:  # the weight second, as te_jax.core.einsum takes it
            inputs, arrow, output = equation.partition("->")
            a, b = inputs.split(",")
            equation, lhs, rhs = f"{b},{a}{arrow}{output}", rhs, lhs
            if not arrow:  # an implicit output keeps its alphabetical order: name it before swapping
                equation = f"{b},{a}->{''.join(sorted(c for c in set(a + b) if (a + b).count(c) == 1))}"
        module = flax_util.get_current_module()
        groups = _einsum_groups(equation, lhs, rhs)
        with autocast(recipe=recipe):
            if isinstance(module, nnx.Module):
                child = _nnx_child(module, op_id, lambda path: te_nnx.EinsumOp(batch_size=groups, path=path))
                y = child(equation, lhs, rhs, precision=precision, preferred_element_type=preferred_element_type)
            else:
                y = _linen_product(module, op_id, rhs, groups, lambda q, state, w, key: core_einsum(
                    equation, lhs, w, precision=precision, preferred_element_type=preferred_element_type,
                    quantizers=q, state=state, key=key))
        return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)

    def ragged_dot(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None,
                   **kwargs):
        """``jax.lax.ragged_dot``; a matched product whose ``rhs`` is a parameter quantized by te_jax."""
        recipe, op_id = self._recipe("ragged_dot")
        if recipe is None or _weight_operand(lhs, rhs) != 1:
            return lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                                  preferred_element_type=preferred_element_type, group_offset=group_offset, **kwargs)
        module = flax_util.get_current_module()
        where = f"te_jax.qwix ragged_dot {op_id} in {'/'.join(map(str, flax_util.get_current_module_path()))}"
        if group_offset is not None:
            raise ValueError(f"te_jax: {where}: group_offset is not supported (te_jax.ragged_dot refuses it)")
        with autocast(recipe=recipe):
            if isinstance(module, nnx.Module):
                child = _nnx_child(module, op_id, lambda path: te_nnx.RaggedDot(rhs.shape[0], path=path))
                y = child(lhs, rhs, group_sizes, precision, preferred_element_type)
            else:
                y = ragged_dot_call(module, _path(module), lhs, rhs, group_sizes, precision, preferred_element_type,
                                    name=op_id, where_=where)
        out_sharding = kwargs.get("out_sharding")
        return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)


def _axes(dims) -> tuple[int, ...]:
    return (dims,) if isinstance(dims, int) else tuple(dims)


def _weight_operand(lhs, rhs) -> int | None:
    """0 or 1: which operand is a parameter of the calling module (rhs when both are); None: neither."""
    if flax_util.find_param(rhs) is not None:
        return 1
    if flax_util.find_param(lhs) is not None:
        return 0
    return None


def _einsum_groups(equation: str, lhs, rhs) -> int | None:
    """The number of batch elements of the kernel (``rhs``) in the einsum as te_jax.core.einsum runs it."""
    plan = parse_einsum(equation, tuple(jnp.shape(lhs)), tuple(jnp.shape(rhs)))
    kept = [d for i, d in enumerate(jnp.shape(rhs)) if i not in plan.rhs_squeeze]
    kept = [d for i, d in enumerate(kept) if i not in plan.rhs_sum]
    batch = _axes(plan.dimension_numbers[1][1])
    return math.prod(kept[a] for a in batch) if batch else None


def _path(module) -> tuple[str, ...]:
    return tuple(str(p) for p in flax_util.get_current_module_path())


def _linen_product(module: nn.Module, op_id: str, weight, groups: int | None, run) -> jax.Array:
    """One intercepted product in a Linen module: ``run(quantizers, state, weight, key) -> (y, new_state)`` with
    the module's "_overwrite_with_gradient" state under ``op_id``."""
    path = _path(module)
    where = f"te_jax.qwix {op_id} in {'/'.join(path) or '(root)'}"
    if inspecting():
        raise ValueError(f"te_jax: {where}: quantization statistics (inspect=True) are not recorded for products "
                         "Qwix intercepts; inspect with te_jax's layers or injected modules")
    q = DenseQuantizers.from_recipe(current_recipe(), path)
    state = {}
    if q.stateful():
        state, weight = overwrite_state(module, q, q.init_state(num_groups=groups), weight, where, name=op_id)
    try:
        with fp8_state_updates():  # the overwrite form applies the update: its gradient is the new state
            y, _ = run(q, state, weight, quantize_key(module, q.any))
    except FP8StateError:
        raise
    except ValueError as err:
        raise ValueError(f"{err} ({where})") from None
    return y


def _nnx_child(module: nnx.Module, op_id: str, make) -> Any:
    """The te_jax.nnx product module of ``op_id`` in ``module``, created (at Qwix's first run) when missing."""
    name = f"te_jax_{op_id}"
    child = getattr(module, name, None)
    if child is None:
        path = tuple(str(p) for p in getattr(module, "qwix_path", ())) + (name,)
        child = make(path)
        setattr(module, name, child)
    return child
