"""``te_jax.flax.Einsum``: flax.linen.Einsum whose GEMMs run in FP8 under te_jax.autocast."""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import opt_einsum
from flax.linen import module as flax_module
from flax.linen.dtypes import promote_dtype

from te_jax.core import DenseQuantizers
from te_jax.core.dot_general import einsum, parse_einsum
from te_jax.core.layer_support import located
from te_jax.flax import _common as C
from te_jax.spec.names import FP8_COLLECTION

Dtype = Any


class Einsum(nn.Module):
    """An einsum with a learnable kernel and bias; quantized with the active autocast recipe.

    flax.linen.Einsum's arguments, parameters ("kernel" of ``shape``, "bias"
    of the kernel's axes that reach the output, the same initializers) and,
    without autocast, its result bit for bit (``jnp.einsum``). Under
    ``te_jax.autocast(recipe=...)`` it calls ``te_jax.core.einsum`` (the input
    is the lhs, the kernel the weight): letters shared by input and kernel and
    absent from the output are contracted on te_jax's dense GEMMs, letters of
    both that reach the output (batch axes, e.g. heads) run on the grouped
    GEMM, with one kernel amax history per batch element under delayed
    scaling. State lives in ``fp8_meta/<path>/<role>`` as for ``DenseGeneral``.

    Attributes:
      shape: the kernel's shape.
      einsum_str: ``"<input>,<kernel>-><output>"``, here or at the call (exactly one of them).
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init, promote_dtype, preferred_element_type:
        flax's.
    """

    shape: tuple[int, ...]
    einsum_str: str | None = None
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: Any = None
    kernel_init: C.Initializer = nn.initializers.lecun_normal()
    bias_init: C.Initializer = nn.initializers.zeros_init()
    promote_dtype: Any = promote_dtype
    preferred_element_type: Dtype | None = None

    @nn.compact
    def __call__(self, inputs: jax.Array, einsum_str: str | None = None) -> jax.Array:
        """``einsum(einsum_str, inputs, kernel) + bias``."""
        einsum_str = flax_module.merge_param("einsum_str", self.einsum_str, einsum_str).replace(" ", "")
        if "->" not in einsum_str:
            raise ValueError("`einsum_str` equation must be explicit and include \"->\".")
        if einsum_str.count(",") != 1:
            raise ValueError("`einsum_str` equation must have exactly two operands and therefore, exactly one comma "
                             f"character, instead of {einsum_str.count(',')}")
        C.check_dtypes(self)
        kernel = self.param("kernel", self.kernel_init, self.shape, self.param_dtype)
        bias, bias_shape = None, None
        if self.use_bias:
            bias_shape, broadcast_shape = self._bias_shape(einsum_str, inputs, kernel)
            bias = self.param("bias", self.bias_init, bias_shape, self.param_dtype)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        recipe = C.recipe_or_none()
        quantizers = DenseQuantizers.from_recipe(recipe, C.module_path(self))
        if not quantizers.any:  # flax.linen.Einsum's product, as flax writes it
            y = jnp.einsum(einsum_str, inputs, kernel, precision=self.precision,
                           preferred_element_type=self.preferred_element_type)
        else:
            C.check_dtypes(self, inputs)
            op = functools.partial(einsum, einsum_str, inputs, kernel, precision=self.precision,
                                   preferred_element_type=self.preferred_element_type, quantizers=quantizers)
            y = self._quantized(op, quantizers, self._groups(einsum_str, inputs.shape, kernel.shape))
        if bias is not None:
            y += jnp.reshape(bias, broadcast_shape)
        return y

    def _groups(self, einsum_str: str, in_shape, kernel_shape) -> int | None:
        """The product of the batch axes' sizes (letters of input, kernel and output), or None without any."""
        try:
            plan = parse_einsum(einsum_str, tuple(in_shape), tuple(kernel_shape))
        except ValueError as err:
            raise ValueError(str(err).replace("te_jax: einsum", f"te_jax: {C.where(self)}: einsum", 1)) from None
        _, (_, rb) = plan.dimension_numbers
        if not rb:
            return None
        # the kernel's axes as the product sees them: size-1 broadcast axes squeezed, its own letters summed
        shape = [d for i, d in enumerate(kernel_shape) if i not in plan.rhs_squeeze]
        shape = [d for i, d in enumerate(shape) if i not in plan.rhs_sum]
        return math.prod(shape[axis] for axis in rb)

    def _quantized(self, op, quantizers: DenseQuantizers, groups: int | None) -> jax.Array:
        """``op`` with the layer's state; with batch axes the weight's state has a leading ``groups`` axis."""
        if groups is None:
            return C.call_op(self, quantizers, op)
        if C.inspecting():
            raise ValueError(f"te_jax: {C.where(self)}: statistics (inspect=True) are not recorded for an einsum with "
                             "batch axes (it runs on the grouped GEMM); turn inspect off for this layer")
        initial = quantizers.init_state(num_groups=groups)
        for role in initial:
            if not self.has_variable(FP8_COLLECTION, role) and not self.is_mutable_collection(FP8_COLLECTION):
                raise ValueError(
                    f"te_jax: {C.where(self)} has no {FP8_COLLECTION} state {role!r}, which this recipe keeps: "
                    "initialize the model under te_jax.autocast with it and apply the whole variables dict")
        state = {r: self.variable(FP8_COLLECTION, r, lambda v=v: v).value for r, v in initial.items()}
        try:
            y, new_state = op(state=state, key=C.quantize_key(self, True))
        except ValueError as err:
            raise located(err, C.where(self)) from None
        C.store_gemm_state(self, new_state)
        return y

    def _bias_shape(self, einsum_str: str, lhs, rhs):
        """flax.linen.Einsum's bias shape and its broadcast shape (the kernel's axes that reach the output)."""
        operands, result, _ = opt_einsum.parser.parse_einsum_input((einsum_str, lhs, rhs))
        rhs_index = {c: i for i, c in enumerate(operands.split(",")[1])}
        broadcast, shape = [1] * len(result), []
        for i, c in enumerate(result):
            if c in rhs_index:
                broadcast[i] = self.shape[rhs_index[c]]
                shape.append(self.shape[rhs_index[c]])
        return shape, broadcast
