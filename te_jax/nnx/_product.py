"""One product on ``te_jax.core.dot_general`` / ``einsum`` with a layer's FP8 state: what the injected
``DotGeneral`` / ``EinsumOp`` and the ``Einsum`` layer share.

Outside autocast, and under a recipe that quantizes nothing for the layer,
the layer runs flax's own product (``lax.dot_general`` / ``jnp.einsum``
with every argument flax passes), so the result is flax's to the bit. Under
a recipe that quantizes, the core op runs with the layer's state, key and
statistics (``run_op``), and the result is resharded to ``out_sharding`` as
flax's product types it.
"""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from te_jax.core.bundles import ROLE_OF
from te_jax.core.dot_general import dot_general as core_dot_general
from te_jax.core.dot_general import einsum as core_einsum
from te_jax.core.dot_general import parse_einsum
from te_jax.nnx._fp8 import NAME_PATHS, Layer, call_quantizers, recipe_or_none, run_op, where
from te_jax.ops.sharding_types import product_type, reshape, retype
from te_jax.recipe.autocast import inspecting

_WEIGHT = ROLE_OF["weight"]


def check_batch_size(batch_size: int | None, where_: str) -> int | None:
    """``batch_size`` as given to a product layer: None or a positive int."""
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"te_jax: {where_}: batch_size must be None or a positive int (the product of the "
                         f"weight's batch axes' sizes), got {batch_size!r}")
    return batch_size


def batch_elements(rhs_shape: Sequence[int], rhs_batch: Sequence[int]) -> int | None:
    """The number of batch elements of a product (None: no batch axis)."""
    return math.prod(rhs_shape[i] for i in rhs_batch) if rhs_batch else None


def _check_weight_state(layer: Layer, quantizers, batch: int | None) -> None:
    """A delayed-scaling weight keeps one amax history per batch element: the stored state must match."""
    if _WEIGHT not in quantizers.stateful() or layer.fp8_meta is None:
        return  # nothing to match, or no state at all (run_op says so)
    have = layer.fp8_meta.get_value().get(_WEIGHT)
    want = jax.eval_shape(functools.partial(quantizers.init_state, num_groups=batch))[_WEIGHT]
    if have is None or jax.tree.map(lambda a: a.shape, have) == jax.tree.map(lambda a: a.shape, want):
        return
    def elements(n: int | None) -> str:
        return f"batch axes of {n} elements in all" if n else "no batch axis"

    raise ValueError(f"te_jax: {where(layer)}: this product has {elements(batch)}, and the FP8 state of its weight "
                     f"was made for {elements(layer.batch_size)}: a delayed-scaling weight keeps one amax history per "
                     f"batch element; construct it with batch_size={batch} (te_jax.nnx.Einsum: write the kernel's "
                     "subscripts without '...')")


def _named_errors(layer: Layer, op: Callable) -> Callable:
    """``op`` whose ValueErrors name the layer (the core ops name themselves "dot_general" / "einsum")."""

    def run(**kwargs):
        try:
            return op(**kwargs)
        except ValueError as err:
            raise ValueError(str(err).replace("te_jax: ", f"te_jax: {where(layer)}: ", 1)) from None

    return run


def run_product(layer: Layer, flax_op: Callable[[], jax.Array], core_op: Callable, batch: Callable[[], int | None],
                out_sharding) -> jax.Array:
    """The layer's product: ``flax_op()``, or ``core_op(quantizers=..., state=..., key=..., inspect=...)``.

    Args:
      layer: the calling layer (a ``Layer`` with ``fp8_meta`` and ``batch_size``).
      flax_op: flax's own product, every argument bound (outside autocast, or nothing quantized).
      core_op: ``te_jax.core.dot_general`` / ``einsum`` with the operands and options bound.
      batch: the product's batch elements (None: no batch axis), for the weight state's check.
      out_sharding: flax's ``out_sharding`` (None: none); the quantized result is resharded to it.
    """
    if recipe_or_none() is None:
        return flax_op()
    quantizers = call_quantizers(layer)
    if not quantizers.any:
        return flax_op()
    if layer.single_owner and layer.path is None and (quantizers.stateful() or inspecting()):
        raise ValueError(
            f"te_jax: {where(layer)} keeps FP8 state or statistics under this autocast, which only a module inside "
            f"the model can keep, and it is not named yet: {NAME_PATHS}. One made at every call "
            f"(flax's dot_general_cls=te_jax.nnx.{type(layer).__name__}) never is: pass an instance "
            f"(dot_general=te_jax.nnx.DotGeneral(), einsum_op=te_jax.nnx.EinsumOp()) or call te_jax.nnx.inject(model)")
    _check_weight_state(layer, quantizers, _named_errors(layer, batch)())
    y = run_op(layer, quantizers, _named_errors(layer, functools.partial(core_op, quantizers=quantizers)))
    return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)


def einsum_batch(equation: str, lhs_shape: Sequence[int], rhs_shape: Sequence[int]) -> int | None:
    """The batch elements of ``jnp.einsum(equation, lhs, rhs)`` as ``te_jax.core.einsum`` runs it (None: none)."""
    plan = parse_einsum(equation, tuple(lhs_shape), tuple(rhs_shape))
    kept = [d for i, d in enumerate(rhs_shape) if i not in plan.rhs_squeeze]
    kept = [d for i, d in enumerate(kept) if i not in plan.rhs_sum]
    return batch_elements(kept, plan.dimension_numbers[1][1])


def einsum_batch_of_kernel(equation: str, kernel_shape: Sequence[int]) -> int | None:
    """The batch elements of ``equation`` known from the kernel alone: the product of the sizes of the kernel's
    letters that the input and the output also have (None: none, or not known: an ellipsis in the kernel's
    subscripts)."""
    inputs, _, output = equation.replace(" ", "").partition("->")
    specs = inputs.split(",")
    if len(specs) != 2 or "." in specs[1]:
        return None
    lhs, rhs = specs
    return batch_elements(kernel_shape, [i for i, c in enumerate(rhs) if c in lhs and c in output])


def flat_operands(lhs: jax.Array, rhs: jax.Array, lhs_contracting: Sequence[int], rhs_contracting: Sequence[int],
                  where_: str = "dot_general"):
    """A product without batch axes as ``[*lhs free, K] @ [K, N]``, and the output's shape ``[*lhs free, *rhs free]``.

    The same matrices ``te_jax.dense`` quantizes and multiplies (the same
    bits), built by transposes and reshapes that merge or split one trailing
    group of axes only, which jax types under Explicit mesh axes where a
    reshape regrouping both sides of a matrix at once is refused.
    """
    lc, rc = tuple(lhs_contracting), tuple(rhs_contracting)
    lf = tuple(i for i in range(lhs.ndim) if i not in lc)
    rf = tuple(i for i in range(rhs.ndim) if i not in rc)
    if [lhs.shape[i] for i in lc] != [rhs.shape[j] for j in rc]:
        raise ValueError(f"te_jax: {where_}: the contracted axes {lc} of the input {lhs.shape} and {rc} of the "
                         f"kernel {rhs.shape} differ in size")
    k = math.prod(lhs.shape[i] for i in lc)
    x = lhs if lf + lc == tuple(range(lhs.ndim)) else jnp.transpose(lhs, lf + lc)
    x = reshape(x, (*x.shape[:len(lf)], k)) if len(lc) != 1 else x
    w = rhs if rc + rf == tuple(range(rhs.ndim)) else jnp.transpose(rhs, rc + rf)
    w = reshape(w, (k, math.prod(rhs.shape[i] for i in rf)))
    return x, w, tuple(lhs.shape[i] for i in lf) + tuple(rhs.shape[i] for i in rf)


def _axes(axes, ndim: int) -> tuple[int, ...] | None:
    """Distinct non-negative axes of a rank-``ndim`` operand, or None (left for the core op's error)."""
    try:
        out = tuple(int(a) % ndim for a in axes if -ndim <= int(a) < ndim)
    except TypeError:
        return None
    return out if len(out) == len(tuple(axes)) == len(set(out)) else None


def flat_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, **kwargs):
    """``te_jax.core.dot_general`` on ``flat_operands`` for a product without batch axes; any other product (or
    malformed dimension numbers, which the core op reports) as given."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError):
        return core_dot_general(lhs, rhs, dimension_numbers, **kwargs)
    lc, rc = _axes(lc, jnp.ndim(lhs)), _axes(rc, jnp.ndim(rhs))
    if lc is None or rc is None or not lc or len(lc) != len(rc) or tuple(lb) or tuple(rb) or \
            [lhs.shape[i] for i in lc] != [rhs.shape[j] for j in rc]:
        return core_dot_general(lhs, rhs, dimension_numbers, **kwargs)
    x, w, out_shape = flat_operands(lhs, rhs, lc, rc)
    y, new_state = core_dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), **kwargs)
    lf, rf = tuple(i for i in range(lhs.ndim) if i not in lc), tuple(i for i in range(rhs.ndim) if i not in rc)
    return retype(reshape(y, out_shape), product_type(lhs, lf, rhs, rf)), new_state


def flat_einsum(equation: str, lhs: jax.Array, rhs: jax.Array, **kwargs):
    """``te_jax.core.einsum`` on ``flat_operands`` for a plain product (no batch axis, nothing summed or broadcast
    first), the result reshaped and transposed to the equation's output; any other equation as given."""
    try:
        plan = parse_einsum(equation, jnp.shape(lhs), jnp.shape(rhs))
    except ValueError:
        return core_einsum(equation, lhs, rhs, **kwargs)  # it raises the same error, as the op
    (lc, rc), (lb, _) = plan.dimension_numbers
    if plan.lhs_squeeze or plan.rhs_squeeze or plan.lhs_sum or plan.rhs_sum or lb or not lc:
        return core_einsum(equation, lhs, rhs, **kwargs)
    x, w, out_shape = flat_operands(lhs, rhs, lc, rc, f"einsum {equation!r}")
    free, k, n = string.ascii_letters[:x.ndim - 1], string.ascii_letters[x.ndim - 1], string.ascii_letters[x.ndim]
    y, new_state = core_einsum(f"{free}{k},{k}{n}->{free}{n}", x, w, **kwargs)
    lf, rf = tuple(i for i in range(lhs.ndim) if i not in lc), tuple(i for i in range(rhs.ndim) if i not in rc)
    y = retype(reshape(y, out_shape), product_type(lhs, lf, rhs, rf))
    return (y if plan.transpose is None else jnp.transpose(y, plan.transpose)), new_state
