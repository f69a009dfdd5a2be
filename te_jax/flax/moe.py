"""``te_jax.flax.MoE``: a dropless mixture-of-experts feed-forward block whose expert GEMMs run quantized.

Router (float32, unquantized) -> top-k routing -> permutation by expert ->
grouped FFN (``te_jax.grouped_dense`` twice, the activation between) ->
un-permutation weighted by the gates, plus optional shared experts. With an
expert-parallel axis (``MeshResource.ep_resource``) the permutation, the
exchange of rows with the experts' devices (``te_jax.moe.dispatch`` /
``combine``) and the grouped FFN run inside ``jax.shard_map``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from te_jax._core import DenseQuantizers
from te_jax._core.quantizers import ROLE_OF
from te_jax.autocast import current as current_autocast
from te_jax.flax import _common as C
from te_jax.flax._call import call_op
from te_jax.flax.dense import DenseGeneral
from te_jax.grouped_dense import grouped_dense, init_state
from te_jax.moe import combine, dispatch, permute, route, unpermute
from te_jax.sharding import axes_of
from te_jax.state import module_path

Dtype = Any
ACTIVATIONS = {
    "swiglu": lambda a, g: jax.nn.silu(a) * g,
    "geglu": lambda a, g: jax.nn.gelu(a) * g,
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}
GATED = ("swiglu", "geglu")
_GEMMS = ("wi", "wo")
_WEIGHT_ROLE = ROLE_OF["weight"]


@dataclasses.dataclass(frozen=True)
class _ExpertQuantizers:
    """One expert GEMM's quantizers, whose state has the experts' leading axis (``grouped_dense.init_state``)."""

    q: DenseQuantizers
    num_experts: int

    @property
    def any(self) -> bool:
        return self.q.any

    def stateful(self) -> dict[str, Any]:
        return self.q.stateful()

    def quantized_roles(self) -> tuple[str, ...]:
        return self.q.quantized_roles()

    def init_state(self) -> dict[str, Any]:
        return init_state(self.q, self.num_experts)


@dataclasses.dataclass(frozen=True)
class _MoEQuantizers:
    wi: _ExpertQuantizers
    wo: _ExpertQuantizers

    @property
    def any(self) -> bool:
        return self.wi.any or self.wo.any


@dataclasses.dataclass(frozen=True)
class _ExpertParallel:
    """Where the experts and tokens of an expert-parallel MoE live on the active mesh."""

    mesh: Any  # the abstract mesh of the jit being traced
    axis: str  # the experts' axis
    token_axes: tuple[str, ...]  # the tokens' axes: the data axes and the experts' axis

    def state_spec(self, role: str) -> P:
        """The partition of a GEMM's FP8 state entry: the weight's has the experts' leading axis."""
        return P(self.axis) if role == _WEIGHT_ROLE else P()


def _no_weight_amax_reduction(q: DenseQuantizers) -> DenseQuantizers:
    """``q`` whose weight amax is kept per device: each device holds other experts, whose amaxes must not mix."""
    if not getattr(q.weight, "reduce_amax", False):
        return q
    return dataclasses.replace(q, weight=dataclasses.replace(q.weight, reduce_amax=False))


def _activate(h: jax.Array, activation: str) -> jax.Array:
    if activation in GATED:
        a, g = jnp.split(h, 2, axis=-1)
        return ACTIVATIONS[activation](a, g)
    return ACTIVATIONS[activation](h)


class MoE(nn.Module):
    """A dropless MoE block; its expert GEMMs are quantized with the active autocast recipe.

    For inputs ``[..., H]`` every token goes to its ``num_experts_per_tok``
    best experts (``te_jax.moe.route``); each expert computes
    ``wo(act(x @ wi))`` on its tokens (two ``te_jax.grouped_dense`` calls) and
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
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"te_jax: {C.where(self)}: activation must be one of {tuple(ACTIVATIONS)}, got "
                             f"{self.activation!r}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"te_jax: {C.where(self)}: num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"[1, num_experts={self.num_experts}]")
        inputs = jnp.asarray(inputs)
        C.check_dtypes(self, inputs)
        e, f, h = self.num_experts, self.intermediate_dim, inputs.shape[-1]
        x = inputs.reshape(-1, h)
        router = C.param(self, "router", self.router_init, (h, e), jnp.float32, self.router_axes)
        logits = jnp.dot(x.astype(jnp.float32), router, precision=lax.Precision.HIGHEST)
        bias = None
        if self.score_function == "sigmoid":
            bias = self.param("expert_bias", nn.initializers.zeros_init(), (e,), jnp.float32)
        r = route(logits, self.num_experts_per_tok, score_function=self.score_function, expert_bias=bias)
        if self.aux_loss_coeff:
            self.sow("intermediates", "aux_loss", jnp.float32(self.aux_loss_coeff) * r.aux_loss)

        width = 2 * f if self.activation in GATED else f
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

        recipe = C.recipe_or_none()
        path = module_path(self)
        quantizers = _MoEQuantizers(*(_ExpertQuantizers(DenseQuantizers.from_recipe(recipe, path + (g,)), e)
                                      for g in _GEMMS))
        ep = self._expert_parallel(x.shape[0])
        if ep is None:
            x_sorted, perm = permute(x, r.expert_ids, e)
            y_sorted = call_op(self, quantizers, functools.partial(
                self._experts, x_sorted, perm.group_sizes, wi, wo, wi_bias, wo_bias, quantizers), gemms=_GEMMS)
            y = unpermute(y_sorted, perm, r.gates)
        else:
            y = call_op(self, quantizers, functools.partial(
                self._sharded_experts, ep, x, r.expert_ids, r.gates, wi, wo, wi_bias, wo_bias, quantizers),
                gemms=_GEMMS)
        if self.num_shared_experts:
            shared = DenseGeneral(self.num_shared_experts * width, use_bias=self.use_bias, dtype=dtype,
                                  param_dtype=self.param_dtype, kernel_axes=tuple(self.wi_axes[1:]), name="shared_wi")(x)
            y = y + DenseGeneral(h, use_bias=self.use_bias, dtype=dtype, param_dtype=self.param_dtype,
                                 kernel_axes=tuple(self.wo_axes[1:]), name="shared_wo")(_activate(shared, self.activation))
        return y.reshape(inputs.shape[:-1] + (h,)).astype(dtype)

    def _expert_parallel(self, num_tokens: int) -> _ExpertParallel | None:
        """The active autocast's expert-parallel placement on the current mesh, checked; None without one."""
        mesh_resource = current_autocast().mesh_resource
        axis = None if mesh_resource is None else mesh_resource.ep_resource
        if axis is None:
            return None
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or axis not in mesh.axis_names:
            raise ValueError(f"te_jax: {C.where(self)}: MeshResource(ep_resource={axis!r}) needs a mesh with that "
                             "axis around the jitted call (jax.set_mesh(mesh)); got "
                             f"{'no mesh' if mesh.empty else f'the axes {mesh.axis_names}'}")
        if axis in mesh.manual_axes:
            raise ValueError(f"te_jax: {C.where(self)}: the expert-parallel MoE runs its own shard_map; call it "
                             f"under jit, not inside a shard_map over {axis!r}")
        size = mesh.shape[axis]
        if self.num_experts % size:
            raise ValueError(f"te_jax: {C.where(self)}: {self.num_experts} experts cannot be split over the {size} "
                             f"devices of mesh axis {axis!r}; use a number of experts divisible by {size}")
        data = axes_of(mesh_resource.dp_resource) + axes_of(mesh_resource.fsdp_resource) + (axis,)
        token_axes = tuple(a for a in dict.fromkeys(data) if a in mesh.axis_names)
        shards = math.prod(mesh.shape[a] for a in token_axes)
        if num_tokens % shards:
            raise ValueError(f"te_jax: {C.where(self)}: {num_tokens} tokens cannot be split over the {shards} "
                             f"devices of mesh axes {token_axes} (data and expert parallel); use a batch whose "
                             f"token count is divisible by {shards}")
        return _ExpertParallel(mesh, axis, token_axes)

    def _sharded_experts(self, ep: _ExpertParallel, x, expert_ids, gates, wi, wo, wi_bias, wo_bias, quantizers, *,
                         state, key, inspect):
        """Permutation, exchange, local experts and way back in ``shard_map``: ``(y, {"wi": .., "wo": ..})``.

        Each device permutes its tokens, sends each row to the device of its
        expert (``dispatch``, dropless), runs the grouped FFN of the experts
        it holds and sends the results back (``combine``). Amaxes are reduced
        over the autocast's axes (the input and gradient ones: global values,
        as on one device) except the weights', which stay per expert.
        """
        local = _MoEQuantizers(*(dataclasses.replace(getattr(quantizers, g), q=_no_weight_amax_reduction(
            getattr(quantizers, g).q)) for g in _GEMMS))
        state = {g: dict(state.get(g) or {}) for g in _GEMMS}
        state_specs = {g: {role: jax.tree.map(lambda _, r=role: ep.state_spec(r), entry)
                           for role, entry in state[g].items()} for g in _GEMMS}
        tokens, experts = P(ep.token_axes), P(ep.axis)
        bias_spec = None if wi_bias is None else experts
        no_key = key is None

        def body(x, expert_ids, gates, wi, wo, wi_bias, wo_bias, state, key):
            x_sorted, perm = permute(x, expert_ids, self.num_experts)
            x_local, local_sizes, exchange = dispatch(x_sorted, perm.group_sizes, ep.axis)
            y_local, new_state = self._experts(x_local, local_sizes, wi, wo, wi_bias, wo_bias, local,
                                               state=state, key=None if no_key else key, inspect=inspect)
            return unpermute(combine(y_local, exchange, ep.axis), perm, gates), new_state

        run = jax.shard_map(body, mesh=ep.mesh,
                            in_specs=(tokens, tokens, tokens, experts, experts, bias_spec, bias_spec, state_specs,
                                      None if no_key else P()),
                            out_specs=(tokens, state_specs))
        return run(x, expert_ids, gates, wi, wo, wi_bias, wo_bias, state, key)

    def _experts(self, x_sorted, group_sizes, wi, wo, wi_bias, wo_bias, quantizers, *, state, key, inspect):
        """The grouped FFN through ``grouped_dense``: ``(y_sorted, {"wi": state, "wo": state})``."""
        if inspect:
            raise ValueError(f"te_jax: {C.where(self)}: inspect=True (quantization statistics) does not cover the "
                             "MoE's expert GEMMs yet; inspect the other layers with a CustomRecipe")
        keys = (None, None) if key is None else (jax.random.fold_in(key, 0), jax.random.fold_in(key, 1))
        h, wi_state = grouped_dense(x_sorted, wi, group_sizes, wi_bias, quantizers=quantizers.wi.q,
                                    state=state.get("wi"), key=keys[0])
        y, wo_state = grouped_dense(_activate(h, self.activation), wo, group_sizes, wo_bias,
                                    quantizers=quantizers.wo.q, state=state.get("wo"), key=keys[1])
        return y, {"wi": wi_state or {}, "wo": wo_state or {}}
