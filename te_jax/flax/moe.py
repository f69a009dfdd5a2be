"""``te_jax.flax.MoE``: a dropless mixture-of-experts feed-forward block whose expert GEMMs run quantized.

Router (float32, unquantized) -> top-k routing -> permutation by expert ->
grouped FFN (``te_jax.grouped_mlp`` with a recipe; without, ``te_jax.grouped_dense``
twice with the activation between) ->
un-permutation weighted by the gates, plus optional shared experts. With an
expert-parallel axis (``MeshResource.ep_resource``) the permutation, the
exchange of rows with the experts' devices (``te_jax.moe.dispatch`` /
``combine``) and the grouped FFN run inside ``jax.shard_map``.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax.flax import _common as C
from te_jax.flax._common import call_op
from te_jax.flax.dense import DenseGeneral
from te_jax.moe.experts import GEMMS, MoEQuantizers, activate, check_config, expert_width, route_tokens, routed_experts
from te_jax.flax._common import module_path

Dtype = Any


class MoE(nn.Module):
    """A dropless MoE block; its expert GEMMs are quantized with the active autocast recipe.

    For inputs ``[..., H]`` every token goes to its ``num_experts_per_tok``
    best experts (``te_jax.moe.route``); each expert computes
    ``wo(act(x @ wi))`` on its tokens (``te_jax.grouped_mlp``) and
    the results are summed weighted by the gates. With autocast off (or no
    recipe) this is the high-precision reference.

    Parameters: "router" ``[H, E]`` (float32), "expert_bias" ``[E]`` (sigmoid
    scoring only: it steers the choice and gets no gradient; update it with
    ``te_jax.moe.update_expert_bias`` and keep it out of weight decay),
    "wi" ``[E, H, F]`` (``[E, H, 2F]`` for gated activations, the activated
    half first), "wo" ``[E, F, H]``, "wi_bias" ``[E, F]`` / "wo_bias"
    ``[E, H]`` with ``use_bias``, and "shared_wi" / "shared_wo" (two
    ``DenseGeneral`` with ``num_shared_experts * F`` hidden features) when
    there are shared experts. FP8 state (delayed scaling) is in
    ``fp8_meta/<path>/wi/<role>`` and ``.../wo/<role>``, the weights' with the
    experts' leading axis.

    Expert parallelism: with ``ep_resource`` in the active autocast's
    ``MeshResource`` (under ``jit`` with the mesh set) the experts and their
    FP8 weight state are split over that axis and the tokens over it and the
    data axes; rows go to their experts' devices and back with all-to-all
    (``te_jax.moe.dispatch`` / ``combine``) inside ``jax.shard_map``. See
    docs/moe.md.

    The load-balancing loss times ``aux_loss_coeff`` is sown as
    ``intermediates/<path>/aux_loss`` (when the coefficient is not 0): apply
    with ``mutable=["intermediates"]`` and add it to the training loss.

    Attributes:
      num_experts: E.
      num_experts_per_tok: k, at most E.
      intermediate_dim: F, each expert's hidden width.
      activation: "swiglu" (default), "geglu", "gelu", "silu" or "relu".
      score_function: "softmax" (Mixtral) or "sigmoid" (DeepSeek-V3, with the expert bias).
      aux_loss_coeff: the weight of the sown load-balancing loss.
      num_shared_experts: experts every token goes through (one MLP of their combined width).
      use_bias: per-expert biases.
      dtype: the computation dtype of the experts (default: inputs and params promoted).
      param_dtype: the parameters' dtype (the router's is float32).
      kernel_init: the experts' initializer, called with ``[E, in, out]``.
      router_init: the router's initializer.
      router_axes, wi_axes, wo_axes: logical axis names of "router" (e.g. ``("embed", None)``), "wi" (e.g.
        ``("expert", "embed", "mlp")``) and "wo" (e.g. ``("expert", "mlp", "embed")``); () for none. The
        biases take the expert and output axes, the shared experts' kernels the last two.
    """

    num_experts: int
    num_experts_per_tok: int
    intermediate_dim: int
    activation: str = "swiglu"
    score_function: str = "softmax"
    aux_loss_coeff: float = 0.0
    num_shared_experts: int = 0
    use_bias: bool = False
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    kernel_init: C.Initializer = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    router_init: C.Initializer = nn.initializers.lecun_normal()
    router_axes: tuple[str | None, ...] = ()
    wi_axes: tuple[str | None, ...] = ()
    wo_axes: tuple[str | None, ...] = ()

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``[..., H]`` -> ``[..., H]``."""
        check_config(C.where(self), self.activation, self.num_experts, self.num_experts_per_tok)
        inputs = jnp.asarray(inputs)
        C.check_dtypes(self, inputs)
        e, f, h = self.num_experts, self.intermediate_dim, inputs.shape[-1]
        x = inputs.reshape(-1, h)
        router = C.param(self, "router", self.router_init, (h, e), jnp.float32, self.router_axes)
        bias = None
        if self.score_function == "sigmoid":
            bias = self.param("expert_bias", nn.initializers.zeros_init(), (e,), jnp.float32)
        r = route_tokens(x, router, bias, self.num_experts_per_tok, self.score_function)
        if self.aux_loss_coeff:
            self.sow("intermediates", "aux_loss", jnp.float32(self.aux_loss_coeff) * r.aux_loss)

        width = expert_width(self.activation, f)
        wi = C.param(self, "wi", self.kernel_init, (e, h, width), self.param_dtype, self.wi_axes)
        wo = C.param(self, "wo", self.kernel_init, (e, f, h), self.param_dtype, self.wo_axes)
        wi_bias = wo_bias = None
        if self.use_bias:
            zeros = nn.initializers.zeros_init()
            wi_bias = C.param(self, "wi_bias", zeros, (e, width), self.param_dtype, tuple(self.wi_axes[::2]))
            wo_bias = C.param(self, "wo_bias", zeros, (e, h), self.param_dtype, tuple(self.wo_axes[::2]))
        dtype = self.dtype or jnp.result_type(x.dtype, self.param_dtype)
        x, wi, wo = x.astype(dtype), wi.astype(dtype), wo.astype(dtype)
        wi_bias, wo_bias = (None if b is None else b.astype(dtype) for b in (wi_bias, wo_bias))

        quantizers = MoEQuantizers.from_recipe(C.recipe_or_none(), module_path(self), e)
        y = call_op(self, quantizers, functools.partial(
            routed_experts, x, r, wi, wo, wi_bias, wo_bias, quantizers, activation=self.activation, num_experts=e,
            where=C.where(self)), gemms=GEMMS)
        if self.num_shared_experts:
            shared = DenseGeneral(self.num_shared_experts * width, use_bias=self.use_bias, dtype=dtype,
                                  param_dtype=self.param_dtype, kernel_axes=tuple(self.wi_axes[1:]),
                                  name="shared_wi")(x)
            y = y + DenseGeneral(h, use_bias=self.use_bias, dtype=dtype, param_dtype=self.param_dtype,
                                 kernel_axes=tuple(self.wo_axes[1:]),
                                 name="shared_wo")(activate(shared, self.activation))
        return y.reshape(inputs.shape[:-1] + (h,)).astype(dtype)
