"""te_jax in flax.nnx models nobody rewrote: ``DotGeneral``, ``EinsumOp`` and ``inject``.

flax.nnx's ``Linear`` and ``LinearGeneral`` take a ``dot_general`` and
``Einsum`` an ``einsum_op``; these modules are te_jax's, holding the FP8
state of that one product::

    with te_jax.autocast(recipe=recipe):                    # the recipe's state is created here
        model = MyModel(rngs=nnx.Rngs(0))                   # plain nnx.Linear / LinearGeneral / Einsum inside
        te_jax.nnx.inject(model)                            # each gets its own DotGeneral / EinsumOp
    with te_jax.autocast(recipe=recipe):
        loss, grads = te_jax.nnx.value_and_grad(loss_fn)(model, x)

or one layer at a time: ``nnx.Linear(..., dot_general=te_jax.nnx.DotGeneral())``,
``nnx.Einsum(..., einsum_op=te_jax.nnx.EinsumOp())``. Outside autocast they
compute exactly what flax computes (``lax.dot_general`` / ``jnp.einsum``
with flax's arguments); under it, ``te_jax.core.dot_general`` /
``te_jax.core.einsum`` with the recipe's quantizers, the product's rhs (the
layer's kernel) as the weight. Their state is ``te_jax.nnx.FP8Meta`` (and
``FP8Stats``), stepped by ``te_jax.nnx.value_and_grad`` like every te_jax.nnx
layer's; their module path is their place in the model
(``"block/q_proj/dot_general"``), given by ``te_jax.nnx.name_paths``.

Each product needs its own instance: one shared by several layers would merge
their state, so ``name_paths`` refuses it. ``nnx.MultiHeadAttention`` hands
one ``qkv_dot_general`` to query, key and value; build it without one and
call ``inject``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from te_jax.core import DenseQuantizers
from te_jax.nnx._fp8 import Layer, init_fp8
from te_jax.nnx._product import batch_elements, check_batch_size, einsum_batch, einsum_batch_of_kernel, \
    flat_dot_general, flat_einsum, run_product
from te_jax.nnx.paths import name_paths


class _Product(Layer):
    """What DotGeneral and EinsumOp share: no parameters, the FP8 state of one product."""

    single_owner = True

    def __init__(self, *, batch_size: int | None = None, rngs: nnx.Rngs | None = None,
                 path: str | Sequence[str] | None = None):
        self.set_path(path)
        self.batch_size = check_batch_size(batch_size, type(self).__name__)
        init_fp8(self, rngs)

    def fp8_quantizers(self, recipe) -> DenseQuantizers:
        return DenseQuantizers.from_recipe(recipe, self.path or ())

    def fp8_initial_state(self, quantizers: DenseQuantizers) -> dict[str, Any]:
        return quantizers.init_state(num_groups=self.batch_size)


class DotGeneral(_Product):
    """``lax.dot_general`` for ``nnx.Linear(dot_general=...)`` / ``nnx.LinearGeneral(dot_general=...)``,
    quantized under ``te_jax.autocast`` with the FP8 state of that one layer's product.

    Args:
      batch_size: the product of the weight's batch axes' sizes
        (``nnx.LinearGeneral``'s ``batch_axis``), for a product with batch
        axes under a recipe that keeps state: a delayed-scaling weight keeps
        one amax history per batch element. None: no batch axis.
      rngs: a "quantize" stream gives the stochastic-rounding keys (NVFP4 gradients).
      path: the module path the recipe's roles carry; left out (None), its
        path in the model (``te_jax.nnx.name_paths``), e.g. ``"block/q_proj/dot_general"``.
    """

    def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None,
                 preferred_element_type=None, *, out_sharding=None) -> jax.Array:
        """``lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding=...)``."""
        flax_op = functools.partial(lax.dot_general, lhs, rhs, dimension_numbers, precision=precision,
                                    preferred_element_type=preferred_element_type, out_sharding=out_sharding)
        core_op = functools.partial(flat_dot_general, lhs, rhs, dimension_numbers, precision=precision,
                                    preferred_element_type=preferred_element_type)
        return run_product(self, flax_op, core_op, lambda: batch_elements(jnp.shape(rhs), dimension_numbers[1][1]),
                           out_sharding)


class EinsumOp(_Product):
    """``jnp.einsum`` of two operands for ``nnx.Einsum(einsum_op=...)``, quantized under ``te_jax.autocast``
    with the FP8 state of that one layer's product (rhs, the layer's kernel, is the weight).

    Args:
      batch_size: the product of the sizes of the kernel's batch axes (its
        letters the input and the output also have), for an equation with
        any under a recipe that keeps state. None: none.
      rngs, path: as ``DotGeneral``'s.
    """

    def __call__(self, equation: str, lhs: jax.Array, rhs: jax.Array, *, precision=None,
                 preferred_element_type=None, out_sharding=None) -> jax.Array:
        """``jnp.einsum(equation, lhs, rhs, precision=..., preferred_element_type=..., out_sharding=...)``."""
        flax_op = functools.partial(jnp.einsum, equation, lhs, rhs, precision=precision,
                                    preferred_element_type=preferred_element_type, out_sharding=out_sharding)
        core_op = functools.partial(flat_einsum, equation, lhs, rhs, precision=precision,
                                    preferred_element_type=preferred_element_type)
        return run_product(self, flax_op, core_op, lambda: einsum_batch(equation, jnp.shape(lhs), jnp.shape(rhs)),
                           out_sharding)


def _owner_name(path: tuple, node: Any) -> str:
    return f"{type(node).__name__} at {'/'.join(map(str, path)) or '(root)'}"


def _custom_product_error(path: tuple, node: Any, what: str, value: Any) -> ValueError:
    return ValueError(f"te_jax: inject: {_owner_name(path, node)} has its own {what} ({value!r}); inject only "
                      f"replaces flax's default: build that layer without it")


def inject(model: Any, *, rngs: nnx.Rngs | None = None) -> Any:
    """Gives every ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` of ``model`` its own te_jax product.

    Call it once the model is built, under the autocast it is built with
    (the recipe whose state the products create). A layer with flax's default
    product gets a new ``DotGeneral`` (``LinearGeneral``: with its batch
    axes' ``batch_size``) or ``EinsumOp`` (``batch_size`` from the
    constructor's equation and kernel shape); one already given a te_jax
    instance keeps it; a ``dot_general_cls=te_jax.nnx.DotGeneral`` becomes an
    instance. Then every te_jax layer is named by its path
    (``te_jax.nnx.name_paths``). te_jax.nnx's own layers are left as they are.

    Args:
      model: the model (any graph node).
      rngs: a "quantize" stream gives each product a fork for its
        stochastic-rounding keys (NVFP4 gradients).

    Returns:
      ``model``, changed in place.

    Raises:
      ValueError: a layer has a custom product of another kind (a
        ``dot_general`` or ``einsum_op`` that is not flax's default), or one
        te_jax product is shared by several layers.
    """
    for path, node in list(nnx.iter_graph(model)):
        if isinstance(node, nnx.Linear):
            if node.dot_general is lax.dot_general:
                node.dot_general = nnx.data(DotGeneral(rngs=rngs))  # was a static function
            elif not isinstance(node.dot_general, DotGeneral):
                raise _custom_product_error(path, node, "dot_general", node.dot_general)
        elif isinstance(node, nnx.LinearGeneral):
            batch_size = math.prod(node.batch_axis.values()) if node.batch_axis else None
            if node.dot_general_cls is DotGeneral:
                node.dot_general_cls = None
            elif node.dot_general_cls is not None:
                raise _custom_product_error(path, node, "dot_general_cls", node.dot_general_cls)
            if node.dot_general is None:
                node.dot_general = nnx.data(DotGeneral(batch_size=batch_size, rngs=rngs))
            elif not isinstance(node.dot_general, DotGeneral):
                raise _custom_product_error(path, node, "dot_general", node.dot_general)
        elif isinstance(node, nnx.Einsum):
            if node.einsum_op is jnp.einsum:
                batch_size = einsum_batch_of_kernel(node.einsum_str, node.kernel_shape)
                node.einsum_op = nnx.data(EinsumOp(batch_size=batch_size, rngs=rngs))
            elif not isinstance(node.einsum_op, EinsumOp):
                raise _custom_product_error(path, node, "einsum_op", node.einsum_op)
    return name_paths(model)
