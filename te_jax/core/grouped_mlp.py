"""``grouped_mlp``: the experts' FFN, ``act(x_g @ Wi_g + bi_g) @ Wo_g + bo_g`` per group, casts fused.

The mixture-of-experts layer's two grouped GEMMs with the activation
between them written by a fused kernel, as ``te_jax.layernorm_mlp`` does for
one dense MLP. ``x`` is in the aligned row layout of
``grouped_dense(..., group_align=...)`` (``te_jax.moe.permute(...,
align=...)`` writes it): group g's rows start at ``sum_{h<g} roundup(m_h,
align)``; the rows between groups give zeros and get zero gradients::

    q = MLPQuantizers(wi=DenseQuantizers.from_recipe(r, path + ("wi",)), wo=...)
    state = q.init_state(num_groups=G)                 # {"wi": {...}, "wo": {...}}, weights' with a G axis
    y, state = grouped_mlp(x, wi, wo, group_sizes, activation="swiglu", quantizers=q, state=state,
                           group_align=span)

Kernels and GEMMs (``x [M, H]``, ``wi [G, H, W]``, ``wo [G, F, H_out]``;
row-grouped GEMMs run on each group's whole span, whose padding rows are zero)::

    forward  xq  = quantize(x)              wi "linear_input", both copies in one pass
             h   = xq @ Wi_g (+ bi_g)
             a   = te_jax_act_fwd(h)        written by wo's "linear_input" quantizer (both copies)
             y   = a @ Wo_g (+ bo_g)
    backward dyq = quantize(dy)             wo "linear_grad_output", both copies
             da  = dyq @ Wo_g^T ;  dWo_g = a_g^T @ dyq_g
             dh  = te_jax_act_bwd(da, h)    written by wi's "linear_grad_output" quantizer (both copies)
             dx  = dh @ Wi_g^T  ;  dWi_g = x_g^T @ dh_g

So neither the activation nor its gradient is written in high precision and
cast again. The state contract, the per-expert weight state, the biases'
gradients (float32 sums per group) and the roles' meanings are those of
``te_jax.grouped_dense``, per GEMM (``{"wi": {role: state}, "wo": ...}``).
Without quantizers it is ``grouped_dense``, the activation, ``grouped_dense``.
Under per-tensor scaling H, F (each half of a gated W) and H_out are zero
padded to multiples of 16 on every platform, as ``grouped_dense`` pads K and
N (``te_jax.core.grouped_tiles``); every activation maps zero to zero.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P
from jax.ad_checkpoint import checkpoint_name

from te_jax.core import (GEMMS, PRE_ACTIVATION, GemmQuant, MLPQuantizers, Plan, as_mlp_quantizers,
                          check_high_precision, cotangent, keep, mesh_resource_or_autocast, raw_key, state_cotangent,
                          state_leaves, updated_state, vary_of)
from te_jax.core.bundles import check_key
from te_jax.core.bundles import FORWARD_FIELDS
from te_jax.recipe.autocast import with_plan_mesh
from te_jax.core.grouped_dense import (aligned_row_layout, bias_grad, check_blocks, check_grouped_inputs,
                                  check_grouped_state, grouped_dense, grouped_matmul, in_groups,
                                  quantize_expert_weights, span_alignment)
from te_jax.core.grouped_tiles import feature_tile, pad_axis
from te_jax.ops import norm_act as act_ops
from te_jax.quantize import fused
from te_jax.spec import reference_norm_act as ref_norm_act
from te_jax.ops.sharding import MeshResource, to_varying
from te_jax.ops.grouped.layout import valid_group_sizes
from te_jax.ops.sharding_types import dim_spec, specs_like, untyped_op

__all__ = ["grouped_mlp"]

_WHERE = "grouped_mlp"


@dataclasses.dataclass(frozen=True)
class _GroupedMLPPlan(Plan):
    """The static facts of one grouped_mlp call (``vary``: x, wi, bi, wo, bo)."""

    q: MLPQuantizers
    activation: str
    align: int
    dtype: Any
    bi_dtype: Any  # None: no bias
    bo_dtype: Any


# Under an Explicit mesh: with the mesh's axes Auto (jax types neither its row gathers nor ragged products);
# y keeps x's split of the rows and the wo's of N, the new state the given state's types.
@untyped_op(lambda out, a: (P(dim_spec(a["x"], 0), dim_spec(a["wo"], 2)), specs_like(out[1], a["state"])))
def grouped_mlp(
    x: jax.Array,
    wi: jax.Array,
    wo: jax.Array,
    group_sizes: jax.Array,
    wi_bias: jax.Array | None = None,
    wo_bias: jax.Array | None = None,
    *,
    activation: str,
    quantizers: MLPQuantizers | Mapping | None = None,
    state: Mapping[str, Any] | None = None,
    key: jax.Array | None = None,
    mesh_resource: MeshResource | None = None,
    group_align: int,
) -> tuple[jax.Array, dict[str, Any] | None]:
    """Per-group ``act(x_g @ wi[g] + wi_bias[g]) @ wo[g] + wo_bias[g]`` over the aligned row groups of ``x``.

    Args:
      x: ``[M, H]`` in the aligned row layout (module docstring), M a multiple of ``group_align``.
      wi: ``[G, H, W]`` (W = 2F for the gated activations, the activated half first); wo: ``[G, F, H_out]``.
        x, wi and wo share the compute dtype.
      group_sizes: int32 ``[G]`` on the device.
      wi_bias, wo_bias: ``[G, W]``, ``[G, H_out]`` or None.
      activation: one of ``te_jax.ops.norm_act.ACTIVATIONS`` (each maps zero to zero, so the padding rows stay
        zero between the GEMMs).
      quantizers: ``MLPQuantizers`` (or ``{"wi": ..., "wo": ...}``), None for high precision.
      state: ``{"wi": state, "wo": state}``, as ``quantizers.init_state(num_groups=G)`` makes it.
      key: PRNG key for stochastic rounding (wi draws from ``fold_in(key, 0)``, wo from ``fold_in(key, 1)``).
      mesh_resource: as in ``te_jax.grouped_dense``.
      group_align: the row layout's alignment: a multiple of both GEMMs' ``span_alignment``.

    Returns:
      ``(y [M, H_out], new_state)`` as ``te_jax.grouped_dense`` returns them, per GEMM.
    """
    q = as_mlp_quantizers(quantizers)
    check_high_precision(_WHERE, x=x, wi=wi, wo=wo, wi_bias=wi_bias, wo_bias=wo_bias)
    num_groups, width, f = _check_shapes(x, wi, wo, activation)
    check_grouped_inputs(x, wi, group_sizes, wi_bias, f"{_WHERE} (wi)")
    check_grouped_inputs(jax.ShapeDtypeStruct((x.shape[0], f), x.dtype), wo, group_sizes, wo_bias, f"{_WHERE} (wo)")
    need = math.lcm(span_alignment(q.wi), span_alignment(q.wo))
    if isinstance(group_align, bool) or not isinstance(group_align, int) or group_align < 1 or group_align % need \
            or x.shape[0] % group_align:
        raise ValueError(f"te_jax: {_WHERE}: group_align must be a positive multiple of {need} (both GEMMs' "
                         f"span_alignment) that divides x's {x.shape[0]} rows, got {group_align!r}; lay x out with "
                         "te_jax.moe.permute(..., align=group_align)")
    group_sizes = valid_group_sizes(group_sizes, x.shape[0], group_align)  # grouped_dense's one meaning of any sizes
    if not q.any:
        y = _high_precision(x, wi, wo, group_sizes, wi_bias, wo_bias, activation, group_align)
        return y, None if state is None else {g: dict((state or {}).get(g) or {}) for g in GEMMS}
    check_blocks(q.wi, x.shape[0], x.shape[1], width, f"{_WHERE} (wi)")
    check_blocks(q.wo, x.shape[0], f, wo.shape[2], f"{_WHERE} (wo)")
    h_out, tile = wo.shape[2], feature_tile(q.wi, q.wo)  # H, W (per half), F, H_out zero padded (exact)
    halves = 2 if activation in act_ops.GATED else 1
    x, wi = pad_axis(x, 1, tile), pad_axis(pad_axis(wi, 1, tile), 2, tile, halves)
    wo = pad_axis(pad_axis(wo, 1, tile), 2, tile)
    wi_bias, wo_bias = pad_axis(wi_bias, 1, tile, halves), pad_axis(wo_bias, 1, tile)
    state = dict(state or {})
    inner = {g: check_grouped_state(qg, state.get(g), num_groups, f"{_WHERE} ({g})") for g, qg in q.by_gemm().items()}
    if key is None:
        for g, qg in q.by_gemm().items():
            check_key(qg, FORWARD_FIELDS, f"{_WHERE} ({g})")
    mesh_resource = mesh_resource_or_autocast(mesh_resource, x, where=_WHERE)
    plan = _GroupedMLPPlan(mesh_resource, tuple((g, state_leaves(inner[g])) for g in GEMMS),
                           (), vary_of(x, wi, wi_bias, wo, wo_bias), None, q, activation, group_align, x.dtype,
                           None if wi_bias is None else wi_bias.dtype, None if wo_bias is None else wo_bias.dtype)
    y, new_inner = _vjp(plan, x, wi, wi_bias, wo, wo_bias, group_sizes, inner, raw_key(key))
    updates = {g: {**dict(state.get(g) or {}), **new_inner[g]} for g in GEMMS}
    return (y if y.shape[1] == h_out else y[:, :h_out]), updated_state(state, updates, None)


def _check_shapes(x, wi, wo, activation: str) -> tuple[int, int, int]:
    """``(G, W, F)`` once the operands' shapes and dtypes agree (the group sizes and biases: ``grouped_dense``'s
    checks, per GEMM)."""
    if activation not in act_ops.ACTIVATIONS:
        raise ValueError(f"te_jax: {_WHERE}: activation must be one of {act_ops.ACTIVATIONS}, got {activation!r}")
    if x.ndim != 2 or wi.ndim != 3 or wo.ndim != 3 or wi.shape[1] != x.shape[1] or wo.shape[0] != wi.shape[0]:
        raise ValueError(f"te_jax: {_WHERE}: x must be [M, H], wi [G, H, W] and wo [G, F, H_out]; got x {x.shape}, "
                         f"wi {wi.shape}, wo {wo.shape}")
    num_groups, width = wi.shape[0], wi.shape[2]
    f = width // 2 if activation in act_ops.GATED else width
    if wo.shape[1] != f or (activation in act_ops.GATED and width % 2):
        raise ValueError(f"te_jax: {_WHERE}: wo must be [G, F, H_out] with F = {f} ({activation} of a width-{width} "
                         f"wi), got {wo.shape}")
    if not x.dtype == wi.dtype == wo.dtype:
        raise TypeError(f"te_jax: {_WHERE}: x, wi and wo must share the compute dtype, got {x.dtype}, {wi.dtype} and "
                        f"{wo.dtype}")
    return num_groups, width, f


def _activate(h: jax.Array, activation: str) -> jax.Array:
    """The fused kernels' activation in XLA (float32 inside), in h's dtype: the unquantized path's."""
    return act_ops.apply_activation(h, activation)


def _high_precision(x, wi, wo, group_sizes, wi_bias, wo_bias, activation: str, group_align: int):
    h, _ = grouped_dense(x, wi, group_sizes, wi_bias, group_align=group_align)
    y, _ = grouped_dense(_activate(h, activation), wo, group_sizes, wo_bias, group_align=group_align)
    return y


def _keys(key):
    return (None, None) if key is None else (jax.random.fold_in(key, 0), jax.random.fold_in(key, 1))


class _Residuals(NamedTuple):
    """What grouped_mlp's backward reads (a pytree); per-GEMM entries are ``{"wi": ..., "wo": ...}``."""

    x: Any  # x quantized, columnwise copy only (wi's wgrad)
    wi: Any  # wi's expert weights quantized, rowwise copies only (dgrad)
    hid: Any  # the first GEMM's output (pre-activation)
    a: Any  # the activation output quantized, columnwise copy only (wo's wgrad)
    wo: Any  # wo's expert weights quantized, rowwise copies only (dgrad)
    group_sizes: Any
    state: dict  # gemm -> role -> incoming state (float32)
    state_grads: dict  # gemm -> role -> the forward roles' state updates (update form)
    key: Any  # raw PRNG key or None


def _forward(plan: _GroupedMLPPlan, x, wi, bi, wo, bo, group_sizes, state, key):
    ki, ko = _keys(key)
    gi = GemmQuant(plan.q.wi, state["wi"], ki, plan.mesh_resource)
    go = GemmQuant(plan.q.wo, state["wo"], ko, plan.mesh_resource)
    row_sizes, member = aligned_row_layout(group_sizes, x.shape[0], plan.align)
    xq = gi.quantize("input", in_groups(x, member), colwise=True, flatten_axis=1)
    wiq = quantize_expert_weights(gi, wi)
    hid = grouped_matmul(keep(xq, "rowwise"), wiq, row_sizes, (1, 0), group_axis=0, align=plan.align, bias=bi,
                         out_dtype=plan.dtype, fast_accum=plan.q.wi.fast_accum)
    if bi is not None:
        hid = in_groups(hid, member)  # the padding rows got the bias; the activation must see zeros there
    hid = checkpoint_name(gi.qdq("output", hid, flatten_axis=1), PRE_ACTIVATION)
    if go.has("input"):
        a = go.run("input", lambda qz, st, k: (fused.activation(hid, plan.activation, qz, st, rowwise=True,
                                                                colwise=True, key=k),))[0]
    else:
        a = fused.activation(hid, plan.activation, out_dtype=plan.dtype)
    woq = quantize_expert_weights(go, wo)
    y = grouped_matmul(keep(a, "rowwise"), woq, row_sizes, (1, 0), group_axis=0, align=plan.align, bias=bo,
                       out_dtype=plan.dtype, fast_accum=plan.q.wo.fast_accum)
    if bo is not None:
        y = in_groups(y, member)
    y = to_varying(go.qdq("output", y, flatten_axis=1), plan.all_vary)
    res = _Residuals(keep(xq, "colwise"), keep(wiq, "rowwise"), hid, keep(a, "colwise"), keep(woq, "rowwise"),
                     group_sizes, {"wi": gi.st, "wo": go.st}, {"wi": gi.grads, "wo": go.grads}, key)
    return (y, {"wi": gi.new_state(), "wo": go.new_state()}), res


def _primal(plan, *args):
    return _forward(plan, *args)[0]


def _backward_gemms(plan: _GroupedMLPPlan, g: GemmQuant, grad, weight, inputs, row_sizes, group_sizes, fast):
    """One GEMM's dgrad ``grad @ W_g^T`` (quantize-dequantized by its grad_input role) and wgrad
    ``inputs_g^T @ grad_g``, from the output gradient ``grad`` (both copies) and the columnwise ``inputs``."""
    dgrad = grouped_matmul(keep(grad, "rowwise"), weight, row_sizes, (1, 1), group_axis=0, align=plan.align,
                           out_dtype=plan.dtype, fast_accum=fast)
    wgrad = grouped_matmul(inputs, keep(grad, "colwise"), group_sizes, (0, 0), group_axis=1, align=plan.align,
                           out_dtype=plan.dtype, fast_accum=fast)
    return g.qdq("grad_input", dgrad, flatten_axis=1), wgrad


def _bwd(plan: _GroupedMLPPlan, res: _Residuals, cts):
    dy = cts[0]
    hid, group_sizes = res.hid, res.group_sizes
    ki, ko = _keys(res.key)
    gi, go = (GemmQuant.backward(qg, res.state[g], k, plan.mesh_resource, None, f"{_WHERE} ({g})")
              for (g, qg), k in zip(plan.q.by_gemm().items(), (ki, ko)))
    row_sizes, member = aligned_row_layout(group_sizes, dy.shape[0], plan.align)
    # Second GEMM.
    dy = in_groups(dy, member)
    dyq = go.quantize("grad_output", dy, colwise=True, flatten_axis=1)
    da, dwo = _backward_gemms(plan, go, dyq, res.wo, res.a, row_sizes, group_sizes, plan.q.wo.backward_fast_accum)
    dbo = None if plan.bo_dtype is None else bias_grad(dy, group_sizes, plan.align, plan.bo_dtype)
    # Activation backward, fused with the cast of dh (wi's grad_output).
    if gi.has("grad_output"):
        dh = gi.run("grad_output", lambda qz, s, k: (fused.activation_grad(da, hid, plan.activation, qz, s,
                                                                           rowwise=True, colwise=True, key=k)[0],))[0]
    else:
        dh = fused.activation_grad(da, hid, plan.activation, out_dtype=plan.dtype)[0]
    dbi = None
    if plan.bi_dtype is not None:  # per group: the kernel's fused column sum spans every group
        dbi = bias_grad(ref_norm_act.act_apply_grad(da, hid, plan.activation), group_sizes, plan.align, plan.bi_dtype)
    # First GEMM.
    dx, dwi = _backward_gemms(plan, gi, dh, res.wi, res.x, row_sizes, group_sizes, plan.q.wi.backward_fast_accum)
    u = plan.all_vary
    vx, vwi, vbi, vwo, vbo = plan.vary
    new = {"wi": gi, "wo": go}
    leaves = dict(plan.state_leaves)
    dstate = {g: state_cotangent(leaves[g], {**res.state_grads[g], **new[g].grads}, u) for g in GEMMS}
    return (cotangent(dx, u, vx), cotangent(dwi, u, vwi), cotangent(dbi, u, vbi), cotangent(dwo, u, vwo),
            cotangent(dbo, u, vbo), None, dstate, None)


_vjp = jax.custom_vjp(_primal, nondiff_argnums=(0,))
_vjp.defvjp(_forward, with_plan_mesh(_bwd))
