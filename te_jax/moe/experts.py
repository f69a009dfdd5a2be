"""What the Linen (``te_jax.flax.MoE``) and NNX (``te_jax.nnx.MoE``) MoE layers share.

Routing, the routed experts (permutation, grouped FFN through
``te_jax.grouped_mlp``, or ``te_jax.grouped_dense`` unquantized, un-permutation; inside ``jax.shard_map`` with an
expert-parallel axis) and their quantizers. Nothing here knows a module
system: a layer passes its description (``where``) for error messages, and
its arrays, state and keys.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from te_jax.core import DenseQuantizers, MLPQuantizers
from te_jax.core.bundles import ROLE_OF
from te_jax.quantize.protocols import StatefulQuantizer
from te_jax.recipe.autocast import current as current_autocast
from te_jax.core.grouped_dense import grouped_dense, span_alignment
from te_jax.core.grouped_mlp import grouped_mlp
from te_jax.moe import Routing, aligned_layout, combine, dispatch, packed_layout, permute, route, unpermute
from te_jax.ops.sharding import axes_of
from te_jax.ops.sharding_types import dim_spec, specs_like, untyped

ACTIVATIONS = {
    "swiglu": lambda a, g: jax.nn.silu(a) * g,
    "geglu": lambda a, g: jax.nn.gelu(a) * g,
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}
GATED = ("swiglu", "geglu")
GEMMS = ("wi", "wo")
_WEIGHT_ROLE = ROLE_OF["weight"]


@dataclasses.dataclass(frozen=True)
class ExpertQuantizers:
    """One expert GEMM's quantizers, whose state has the experts' leading axis (a ``GemmBundle``,
    ``te_jax.core.bundles``: its ``init_state`` is ``DenseQuantizers.init_state(num_groups=num_experts)``)."""

    q: DenseQuantizers
    num_experts: int

    @property
    def any(self) -> bool:
        return self.q.any

    def stateful(self) -> dict[str, StatefulQuantizer]:
        return self.q.stateful()

    def quantized_roles(self) -> tuple[str, ...]:
        return self.q.quantized_roles()

    def init_state(self) -> dict[str, Any]:
        return self.q.init_state(num_groups=self.num_experts)


@dataclasses.dataclass(frozen=True)
class MoEQuantizers:
    """The quantizers of the two expert GEMMs, "wi" and "wo" (a ``MultiGemmBundle``, ``te_jax.core.bundles``)."""

    wi: ExpertQuantizers
    wo: ExpertQuantizers

    @property
    def any(self) -> bool:
        return self.wi.any or self.wo.any

    def by_gemm(self) -> dict[str, ExpertQuantizers]:
        return {"wi": self.wi, "wo": self.wo}

    def quantized_roles(self) -> dict[str, tuple[str, ...]]:
        return {g: q.quantized_roles() for g, q in self.by_gemm().items()}

    def init_state(self) -> dict[str, dict]:
        return {g: q.init_state() for g, q in self.by_gemm().items()}

    @classmethod
    def from_recipe(cls, recipe, path: tuple[str, ...], num_experts: int) -> MoEQuantizers:
        """The recipe's quantizers for the GEMMs ``<path>/wi`` and ``<path>/wo`` (none without a recipe)."""
        return cls(*(ExpertQuantizers(DenseQuantizers.from_recipe(recipe, path + (g,)), num_experts) for g in GEMMS))


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Where the experts and tokens of an expert-parallel MoE live on the active mesh."""

    mesh: Any  # the abstract mesh of the jit being traced
    axis: str  # the experts' axis
    token_axes: tuple[str, ...]  # the tokens' axes: the data axes and the experts' axis

    def state_spec(self, role: str) -> P:
        """The partition of a GEMM's FP8 state entry: the weight's has the experts' leading axis."""
        return P(self.axis) if role == _WEIGHT_ROLE else P()


def check_config(where: str, activation: str, num_experts: int, num_experts_per_tok: int) -> None:
    """The activation is known and ``1 <= num_experts_per_tok <= num_experts`` (a clear error otherwise)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"te_jax: {where}: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    if not 1 <= num_experts_per_tok <= num_experts:
        raise ValueError(f"te_jax: {where}: num_experts_per_tok ({num_experts_per_tok}) must be in "
                         f"[1, num_experts={num_experts}]")


def expert_width(activation: str, intermediate_dim: int) -> int:
    """The output width of "wi": ``2 F`` for gated activations (the activated half first), else ``F``."""
    return 2 * intermediate_dim if activation in GATED else intermediate_dim


def activate(h: jax.Array, activation: str) -> jax.Array:
    """The activation of the first GEMM's output (gated ones split its last axis in halves)."""
    if activation in GATED:
        a, g = jnp.split(h, 2, axis=-1)
        return ACTIVATIONS[activation](a, g)
    return ACTIVATIONS[activation](h)


def route_tokens(x: jax.Array, router: jax.Array, expert_bias: jax.Array | None, num_experts_per_tok: int,
                 score_function: str) -> Routing:
    """The router's float32 logits of ``x`` ``[T, H]`` (unquantized, highest precision) and their top-k routing.

    Under an Explicit mesh this runs with the mesh's axes Auto (jax types no per-token scatter or top-k of split
    tokens); the per-token results keep x's split of the tokens.
    """
    tokens = P(dim_spec(x, 0))
    return untyped(_route_tokens, lambda r: Routing(*(tokens if f in _PER_TOKEN else P() for f in Routing._fields)),
                   x, router, expert_bias, num_experts_per_tok, score_function)


_PER_TOKEN = ("expert_ids", "gates", "probs")


def _route_tokens(x, router, expert_bias, num_experts_per_tok: int, score_function: str) -> Routing:
    logits = jnp.dot(x.astype(jnp.float32), router, precision=lax.Precision.HIGHEST)
    return route(logits, num_experts_per_tok, score_function=score_function, expert_bias=expert_bias)


def expert_parallel(where: str, num_experts: int, num_tokens: int) -> ExpertParallel | None:
    """The active autocast's expert-parallel placement on the current mesh, checked; None without one."""
    mesh_resource = current_autocast().mesh_resource
    axis = None if mesh_resource is None else mesh_resource.ep_resource
    if axis is None:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        raise ValueError(f"te_jax: {where}: MeshResource(ep_resource={axis!r}) needs a mesh with that axis around "
                         f"the jitted call (jax.set_mesh(mesh)); got "
                         f"{'no mesh' if mesh.empty else f'the axes {mesh.axis_names}'}")
    if axis in mesh.manual_axes:
        raise ValueError(f"te_jax: {where}: the expert-parallel MoE runs its own shard_map; call it under jit, not "
                         f"inside a shard_map over {axis!r}")
    size = mesh.shape[axis]
    if num_experts % size:
        raise ValueError(f"te_jax: {where}: {num_experts} experts cannot be split over the {size} devices of mesh "
                         f"axis {axis!r}; use a number of experts divisible by {size}")
    data = axes_of(mesh_resource.dp_resource) + axes_of(mesh_resource.fsdp_resource) + (axis,)
    token_axes = tuple(a for a in dict.fromkeys(data) if a in mesh.axis_names)
    shards = math.prod(mesh.shape[a] for a in token_axes)
    if num_tokens % shards:
        raise ValueError(f"te_jax: {where}: {num_tokens} tokens cannot be split over the {shards} devices of mesh "
                         f"axes {token_axes} (data and expert parallel); use a batch whose token count is divisible "
                         f"by {shards}")
    return ExpertParallel(mesh, axis, token_axes)


def routed_experts(x: jax.Array, routing: Routing, wi: jax.Array, wo: jax.Array, wi_bias: jax.Array | None,
                   wo_bias: jax.Array | None, quantizers: MoEQuantizers, *, state: dict[str, Any],
                   **options) -> tuple[jax.Array, dict]:
    """``_routed_experts``; under an Explicit mesh with the mesh's axes Auto (its permutation scatters rows by
    expert, which jax cannot type from split tokens). y keeps x's split of the tokens and wo's of H, as
    ``x @ wo`` would; the new state is typed as the state given."""
    y_spec = P(dim_spec(x, 0), dim_spec(wo, 2))
    return untyped(_routed_experts, lambda out: (y_spec, specs_like(out[1], state)), x, routing, wi, wo, wi_bias,
                   wo_bias, quantizers, state=state, **options)


def _routed_experts(x: jax.Array, routing: Routing, wi: jax.Array, wo: jax.Array, wi_bias: jax.Array | None,
                    wo_bias: jax.Array | None, quantizers: MoEQuantizers, *, activation: str, num_experts: int,
                    where: str, state: dict[str, Any], key: jax.Array | None, inspect) -> tuple[jax.Array, dict]:
    """``sum_j gates[t, j] * FFN_{expert_ids[t, j]}(x[t])``: ``(y [T, H], {"wi": state, "wo": state})``.

    The op a layer runs with its FP8 state (``call_op`` / ``run_op``): on one
    device, permutation by expert, the grouped FFN and un-permutation; with
    ``MeshResource.ep_resource`` in the active autocast the same inside
    ``jax.shard_map`` with the rows exchanged with their experts' devices.

    Args:
      x: ``[T, H]`` tokens in the computation dtype.
      routing: ``route_tokens``'s result for ``x``.
      wi, wo: ``[E, H, W]`` and ``[E, F, H]`` expert kernels; wi_bias, wo_bias: ``[E, W]``, ``[E, H]`` or None.
      quantizers: the GEMMs' quantizers (``MoEQuantizers.from_recipe``).
      activation: a key of ``ACTIVATIONS``.
      num_experts: E.
      where: the layer, for error messages.
      state, key, inspect: the GEMMs' FP8 state ``{"wi": .., "wo": ..}``, stochastic-rounding key, inspection flag.
    """
    ep = expert_parallel(where, num_experts, x.shape[0])
    if ep is not None:
        return _sharded_experts(ep, x, routing.expert_ids, routing.gates, wi, wo, wi_bias, wo_bias, quantizers,
                                activation=activation, num_experts=num_experts, where=where, state=state, key=key,
                                inspect=inspect)
    align = _row_align(quantizers)
    x_sorted, perm = permute(x, routing.expert_ids, num_experts, align=align)
    y_sorted, new_state = _experts(x_sorted, perm.group_sizes, wi, wo, wi_bias, wo_bias, quantizers,
                                   activation=activation, where=where, state=state, key=key, inspect=inspect,
                                   group_align=align)
    return unpermute(y_sorted, perm, routing.gates), new_state


def _row_align(quantizers: MoEQuantizers) -> int:
    """The row alignment of the experts' rows: what both GEMMs' wgrad operands need (1 unquantized).

    With it the permutation writes each expert's rows where its wgrad span starts, so neither GEMM copies its
    operands into spans, and each activation and gradient is quantized once, both copies in one pass.
    """
    return math.lcm(*(span_alignment(e.q) for e in quantizers.by_gemm().values()))


def _no_weight_amax_reduction(q: DenseQuantizers) -> DenseQuantizers:
    """``q`` whose weight amax is kept per device: each device holds other experts, whose amaxes must not mix."""
    if not (isinstance(q.weight, StatefulQuantizer) and q.weight.reduce_amax):
        return q
    return dataclasses.replace(q, weight=dataclasses.replace(q.weight, reduce_amax=False))


def _sharded_experts(ep: ExpertParallel, x, expert_ids, gates, wi, wo, wi_bias, wo_bias, quantizers: MoEQuantizers,
                     *, activation: str, num_experts: int, where: str, state, key, inspect):
    """Permutation, exchange, local experts and way back in ``shard_map``: ``(y, {"wi": .., "wo": ..})``.

    Each device permutes its tokens, sends each row to the device of its
    expert (``dispatch``, dropless), runs the grouped FFN of the experts it
    holds and sends the results back (``combine``). Amaxes are reduced over
    the autocast's axes (the input and gradient ones: global values, as on
    one device) except the weights', which stay per expert.
    """
    local = MoEQuantizers(*(dataclasses.replace(e, q=_no_weight_amax_reduction(e.q))
                            for e in quantizers.by_gemm().values()))
    state = {g: dict(state.get(g) or {}) for g in GEMMS}
    state_specs = {g: {role: jax.tree.map(lambda _, r=role: ep.state_spec(r), entry)
                       for role, entry in state[g].items()} for g in GEMMS}
    tokens, experts = P(ep.token_axes), P(ep.axis)
    bias_spec = None if wi_bias is None else experts
    no_key = key is None

    align = _row_align(quantizers)

    def body(x, expert_ids, gates, wi, wo, wi_bias, wo_bias, state, key):
        x_sorted, perm = permute(x, expert_ids, num_experts)
        x_local, local_sizes, exchange = dispatch(x_sorted, perm.group_sizes, ep.axis)
        rows = x_local.shape[0]
        if align > 1:  # the local experts' rows moved to the aligned layout, as on one device
            x_local = aligned_layout(x_local, local_sizes, align)
        y_local, new_state = _experts(x_local, local_sizes, wi, wo, wi_bias, wo_bias, local, activation=activation,
                                      where=where, state=state, key=None if no_key else key, inspect=inspect,
                                      group_align=align)
        if align > 1:
            y_local = packed_layout(y_local, local_sizes, align, rows)
        return unpermute(combine(y_local, exchange, ep.axis), perm, gates), new_state

    run = jax.shard_map(body, mesh=ep.mesh,
                        in_specs=(tokens, tokens, tokens, experts, experts, bias_spec, bias_spec, state_specs,
                                  None if no_key else P()),
                        out_specs=(tokens, state_specs))
    return run(x, expert_ids, gates, wi, wo, wi_bias, wo_bias, state, key)


def _experts(x_sorted, group_sizes, wi, wo, wi_bias, wo_bias, quantizers: MoEQuantizers, *, activation: str,
             where: str, state, key, inspect, group_align: int = 1):
    """The grouped FFN: ``(y_sorted, {"wi": state, "wo": state})``.

    ``group_align`` > 1: the experts' rows start at multiples of it (``permute(..., align=group_align)``) and
    ``grouped_mlp`` runs the FFN with the activation's casts fused; 1: ``grouped_dense``, the activation,
    ``grouped_dense``.
    """
    if inspect:
        raise ValueError(f"te_jax: {where}: inspect=True (quantization statistics) does not cover the MoE's expert "
                         "GEMMs yet; inspect the other layers with a CustomRecipe")
    if group_align > 1:  # the aligned layout: the FFN with its activation casts fused
        y, new_state = grouped_mlp(x_sorted, wi, wo, group_sizes, wi_bias, wo_bias, activation=activation,
                                   quantizers=MLPQuantizers(quantizers.wi.q, quantizers.wo.q),
                                   state={g: state.get(g) for g in GEMMS}, key=key, group_align=group_align)
        return y, {g: (new_state or {}).get(g) or {} for g in GEMMS}
    keys = (None, None) if key is None else (jax.random.fold_in(key, 0), jax.random.fold_in(key, 1))
    h, wi_state = grouped_dense(x_sorted, wi, group_sizes, wi_bias, quantizers=quantizers.wi.q,
                                state=state.get("wi"), key=keys[0], group_align=group_align)
    y, wo_state = grouped_dense(activate(h, activation), wo, group_sizes, wo_bias, quantizers=quantizers.wo.q,
                                state=state.get("wo"), key=keys[1], group_align=group_align)
    return y, {"wi": wi_state or {}, "wo": wo_state or {}}

