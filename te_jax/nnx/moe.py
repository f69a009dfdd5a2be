"""``MoE``: the dropless mixture-of-experts block of ``te_jax.flax.MoE`` in NNX form."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers

from te_jax.core.layer_support import canonical_input, check_dtypes
from te_jax.moe.experts import GEMMS, MoEQuantizers, activate, check_config, expert_width, route_tokens, routed_experts
from te_jax.nnx._fp8 import Layer, call_quantizers, init_fp8, run_op, where
from te_jax.nnx.normalization import LayerNormLinear, param

Dtype = Any


class MoE(Layer):
    """A dropless MoE block whose expert GEMMs are quantized with the active autocast recipe.

    ``te_jax.flax.MoE`` in NNX form, on the same routing and grouped FFN: for
    inputs ``[..., H]`` every token goes to its ``num_experts_per_tok`` best
    experts (``te_jax.moe.route`` on float32, unquantized router logits);
    each expert computes ``wo(act(x @ wi))`` on its tokens
    (``te_jax.grouped_mlp``) and the results are summed weighted by
    the gates. With autocast off (or no recipe) this is the high-precision
    reference.

    Parameters (the Linen layer's names and shapes, drawn in this order):
    "router" ``[H, E]`` (float32), "expert_bias" ``[E]`` (sigmoid scoring
    only: it steers the choice and gets no gradient; update it with
    ``te_jax.moe.update_expert_bias`` and keep it out of weight decay), "wi"
    ``[E, H, F]`` (``[E, H, 2F]`` for gated activations, the activated half
    first), "wo" ``[E, F, H]``, "wi_bias" ``[E, F]`` / "wo_bias" ``[E, H]``
    with ``use_bias``, and the submodules ``shared_wi`` / ``shared_wo``
    (``LayerNormLinear`` without norm: "kernel", "bias", ``num_shared_experts
    * F`` hidden features) when there are shared experts. FP8 state (delayed
    scaling) is ``fp8_meta == {"wi": {role: state}, "wo": {...}}``, the
    weights' with the experts' leading axis, and the shared experts' in their
    own ``fp8_meta``: the Linen layer's "fp8_meta" entries.

    Expert parallelism: with ``ep_resource`` in the active autocast's
    ``MeshResource`` (under ``jit`` with the mesh set) the experts and their
    FP8 weight state are split over that axis, as for the Linen layer (see
    docs/moe.md).

    The load-balancing loss times ``aux_loss_coeff`` (when not 0) is sown as
    ``nnx.Intermediate`` "aux_loss" (``Module.sow``, a tuple with one entry
    per call): collect it with ``nnx.capture``, e.g.
    ``y, inter = nnx.capture(model, nnx.Intermediate)(x)`` and
    ``sum(inter["aux_loss"])`` (nested under the layer's attribute path in a
    larger model), and add it to the training loss. Outside ``nnx.capture``
    flax keeps the sown tuple on the layer as the attribute ``aux_loss``
    (which flax deprecates), growing by one entry per call.

    Args:
      in_features: H.
      num_experts, num_experts_per_tok, intermediate_dim, activation, score_function, aux_loss_coeff,
        num_shared_experts, use_bias, dtype: as the attributes of ``te_jax.flax.MoE`` (``use_bias`` also
        gives the shared experts biases).
      param_dtype: the parameters' dtype (the router's is float32).
      kernel_init: the experts' initializer, called with ``[E, in, out]``.
      router_init: the router's initializer.
      router_axes, wi_axes, wo_axes: logical axis names of "router", "wi" and "wo"; () for none. The biases
        take the expert and output axes, the shared experts' kernels the last two.
      rngs: ``params`` draws the parameters; a "quantize" stream gives stochastic-rounding keys.
      path: the module path the recipe's roles carry (see ``te_jax.nnx.Linear``).
    """

    fp8_gemms = GEMMS

    def __init__(self, in_features: int, num_experts: int, num_experts_per_tok: int, intermediate_dim: int, *,
                 activation: str = "swiglu", score_function: str = "softmax", aux_loss_coeff: float = 0.0,
                 num_shared_experts: int = 0, use_bias: bool = False, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32,
                 kernel_init=initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,)),
                 router_init=initializers.lecun_normal(), router_axes: Sequence[str | None] = (),
                 wi_axes: Sequence[str | None] = (), wo_axes: Sequence[str | None] = (), rngs: nnx.Rngs,
                 path: str | Sequence[str] | None = None):
        self.set_path(path)
        check_dtypes(where(self), dtype, param_dtype)
        check_config(where(self), activation, num_experts, num_experts_per_tok)
        e, f, h = int(num_experts), int(intermediate_dim), int(in_features)
        width = expert_width(activation, f)
        wi_axes, wo_axes = tuple(wi_axes), tuple(wo_axes)
        self.router = param(router_init, rngs, (h, e), jnp.float32, router_axes)
        self.expert_bias = nnx.data(None)
        if score_function == "sigmoid":
            self.expert_bias = nnx.Param(jnp.zeros((e,), jnp.float32))
        self.wi = param(kernel_init, rngs, (e, h, width), param_dtype, wi_axes)
        self.wo = param(kernel_init, rngs, (e, f, h), param_dtype, wo_axes)
        self.wi_bias = self.wo_bias = nnx.data(None)
        if use_bias:
            zeros = initializers.zeros_init()
            self.wi_bias = param(zeros, rngs, (e, width), param_dtype, wi_axes[::2])
            self.wo_bias = param(zeros, rngs, (e, h), param_dtype, wo_axes[::2])
        self.shared_wi = self.shared_wo = nnx.data(None)
        if num_shared_experts:
            shared = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, enable_layernorm=False, rngs=rngs)
            self.shared_wi = LayerNormLinear(h, num_shared_experts * width, kernel_axes=wi_axes[1:],
                                             path=self.child_path("shared_wi"), **shared)
            self.shared_wo = LayerNormLinear(num_shared_experts * f, h, kernel_axes=wo_axes[1:],
                                             path=self.child_path("shared_wo"), **shared)
        self.in_features, self.num_experts, self.num_experts_per_tok = h, e, int(num_experts_per_tok)
        self.intermediate_dim, self.activation, self.score_function = f, activation, score_function
        self.aux_loss_coeff, self.num_shared_experts, self.use_bias = aux_loss_coeff, num_shared_experts, use_bias
        self.dtype, self.param_dtype = dtype, param_dtype
        init_fp8(self, rngs)

    def fp8_quantizers(self, recipe) -> MoEQuantizers:
        return MoEQuantizers.from_recipe(recipe, self.path or (), self.num_experts)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``[..., H]`` -> ``[..., H]``; sows the scaled load-balancing loss (see the class docstring)."""
        inputs = canonical_input(inputs)
        check_dtypes(where(self), x=inputs)
        h = self.in_features
        if inputs.shape[-1] != h:
            raise ValueError(f"te_jax: {where(self)}: the input's last axis is {inputs.shape[-1]}, in_features is {h}")
        x = inputs.reshape(-1, h)
        bias = self.expert_bias[...] if self.expert_bias is not None else None
        r = route_tokens(x, self.router[...], bias, self.num_experts_per_tok, self.score_function)
        if self.aux_loss_coeff:
            self.sow(nnx.Intermediate, "aux_loss", jnp.float32(self.aux_loss_coeff) * r.aux_loss)

        dtype = self.dtype or jnp.result_type(x.dtype, self.param_dtype)
        x, wi, wo = x.astype(dtype), self.wi[...].astype(dtype), self.wo[...].astype(dtype)
        wi_bias, wo_bias = (None if b is None else b[...].astype(dtype) for b in (self.wi_bias, self.wo_bias))
        quantizers = call_quantizers(self)
        y = run_op(self, quantizers, functools.partial(
            routed_experts, x, r, wi, wo, wi_bias, wo_bias, quantizers, activation=self.activation,
            num_experts=self.num_experts, where=where(self)))
        if self.num_shared_experts:
            y = y + self.shared_wo(activate(self.shared_wi(x), self.activation))
        return y.reshape(inputs.shape[:-1] + (h,)).astype(dtype)
