"""``layernorm_mlp``: ``act(norm(x) @ W1 + b1) @ W2 + b2`` with every cast fused into a kernel.

The functional core of ``te_jax.flax.LayerNormMLP``. Two GEMMs, "wi" (``W1
[H, N1]``) and "wo" (``W2 [F, H_out]``), each with its own quantizers
(``MLPQuantizers``) and state (``{"wi": {role: state}, "wo": {role: state}}``)::

    q = MLPQuantizers.from_recipe(recipe)
    y, state = layernorm_mlp(x, gamma, beta, w1, b1, w2, b2, activation="gelu", quantizers=q,
                             state=q.init_state())

Kernels and GEMMs (``x`` viewed as ``[M, H]``)::

    forward  ln = te_jax_norm_fwd(x)          written by wi's "linear_input" quantizer (row + col copies)
             h  = ln @ W1 + b1                (W1 columnwise, wi "linear_weight"; bias in the GEMM epilogue)
             a  = te_jax_act_fwd(h)           written by wo's "linear_input" quantizer (row + col copies)
             y  = a @ W2 + b2
    backward dyq = quantize(dy)               wo "linear_grad_output"
             da  = dyq @ W2^T ;  dW2 = a^T @ dyq ;  db2 = sum(dy)
             dh, db1 = te_jax_act_bwd(da, h)  written by wi's "linear_grad_output" quantizer, dbias fused
             dln = dh @ W1^T  ;  dW1 = ln^T @ dh
             dx, dgamma, dbeta = te_jax_norm_bwd(dln)

No high-precision copy of ``ln``, ``a`` or ``dh`` is written. Gated
activations ("swiglu", "geglu") take ``h = [a | g]`` (``N1 = 2F``; a W1 of
shape ``[H, 2, F]`` flattens to exactly that). With ``dropout_mask`` the
activation is computed unquantized, multiplied by the mask, then quantized
(dropout sits between the activation and its cast, so they cannot fuse).

Everything else (roles left in high precision, "linear_output" and
"linear_grad_input" quantize-dequantize, keys, statistics, the state update
carried as the gradient of ``state``, remat names) is as in
``te_jax.layernorm_dense`` (``te_jax.core``), per GEMM; the first GEMM's
output is also named ``PRE_ACTIVATION``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from te_jax.core import (GEMMS, PRE_ACTIVATION, GemmQuant, MLPQuantizers, Plan, as_mlp_quantizers, check_gemm,
                          check_no_dot_general, cotangent, given_stats, high_precision_state,
                          keep, mesh_resource_or_autocast, raw_key, state_cotangent, state_leaves, updated_state,
                          vary_of)
from te_jax.core.dense import dense
from te_jax.core.gemm_quant import NormSpec, as_norm, norm_backward, norm_input, split_stats, with_stats
from te_jax.core.gemm_quant import NORM_ACT_OUTPUT, check_recompute, recomputing_norm_act
from te_jax.core.layernorm_dense import layernorm_dense
from te_jax.core.unquantized import activation as unquantized_activation
from te_jax.core.unquantized import check_dtypes, normalize
from te_jax.recipe.autocast import with_plan_mesh
from te_jax.core.stats import Sample, as_sample, stats_cotangent, stats_input, stats_leaves
from te_jax.ops import norm_act as act_ops
from te_jax.quantize import fused
from te_jax.ops.sharding import MeshResource, to_varying
from te_jax.ops.sharding_types import dot_general as typed_dot, product_type, reshape, retype

__all__ = ["ACTIVATIONS", "GATED", "GEMMS", "MLPQuantizers", "act_out_features", "layernorm_mlp"]

ACTIVATIONS = act_ops.ACTIVATIONS
GATED = act_ops.GATED
_WHERE = "layernorm_mlp"


def act_out_features(activation: str, n1: int, where: str) -> int:
    """F, the activation output's width, for a first GEMM of width ``n1``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"te_jax: {where}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if activation in GATED:
        if n1 % 2:
            raise ValueError(f"te_jax: {where}: {activation} needs an even first-GEMM width [a | g], got {n1}")
        return n1 // 2
    return n1


@dataclasses.dataclass(frozen=True)
class _MLPPlan(Plan):
    """The static facts of one layernorm_mlp call.

    ``state_leaves`` and ``stats_leaves`` are per GEMM, ``(("wi", ...), ("wo", ...))``;
    ``vary`` is of x, gamma, beta, k1, b1, k2, b2, mask.
    """

    q: MLPQuantizers
    norm: NormSpec | None
    activation: str
    dtype: Any
    x_dtype: Any
    b1_dtype: Any
    b2_dtype: Any


def layernorm_mlp(
    x: jax.Array,
    gamma: jax.Array | None,
    beta: jax.Array | None,
    kernel_1: jax.Array,
    bias_1: jax.Array | None,
    kernel_2: jax.Array,
    bias_2: jax.Array | None = None,
    *,
    activation: str = "gelu",
    norm_type: str | None = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    dropout_mask: jax.Array | None = None,
    quantizers: MLPQuantizers | Mapping | None = None,
    state: Mapping[str, Any] | None = None,
    key: jax.Array | None = None,
    mesh_resource: MeshResource | None = None,
    precision=None,
    inspect: bool | Sample = False,
    dot_generals=None,
    recompute_norm_act: bool = False,
) -> tuple[jax.Array, dict[str, Any] | None]:
    """``act(norm(x) @ kernel_1 + bias_1) [* dropout_mask] @ kernel_2 + bias_2``.

    Args:
      x: ``[..., H]``.
      gamma, beta: the norm's ``[H]`` parameters (see ``layernorm_dense``).
      kernel_1: ``[H, *]``, flattened to ``[H, N1]`` (``[H, 2, F]`` for gated activations).
      bias_1: shaped like ``kernel_1.shape[1:]``, or None.
      kernel_2: ``[F, H_out]`` (F = N1, or N1/2 when gated); bias_2 ``[H_out]`` or None.
        The kernels' dtype is the compute dtype.
      activation: one of ``ACTIVATIONS``.
      norm_type, zero_centered_gamma, epsilon: the norm (None: none).
      dropout_mask: ``[..., F]``, multiplied into the activation output (e.g.
        ``bernoulli(keep) / keep``), or None.
      quantizers: ``MLPQuantizers`` (or ``{"wi": ..., "wo": ...}``), None for high precision.
      state: ``{"wi": {role: state}, "wo": {role: state}}`` for the stateful quantizers; with
        ``inspect``, the statistics input ``state["fp8_stats"] = {"wi": {role: {stat: f32[]}}, "wo": ...}``
        (default: zeros), as in ``te_jax.dense``.
      key: PRNG key for stochastic rounding (wi draws from ``fold_in(key, 0)``, wo from ``fold_in(key, 1)``).
      mesh_resource, precision: as in ``te_jax.dense``.
      inspect: quantization statistics, as in ``te_jax.dense``, per GEMM.
      dot_generals: ``(first, second)`` products of the unquantized path instead of
        ``lax.dot_general`` (e.g. flax ``Fp8DotGeneral`` instances); only without quantizers.
      recompute_norm_act: the backward keeps neither the norm's output nor the activation's (their FP8
        copies under a recipe, bf16 without) and recomputes them from the input and the pre-activation,
        which it keeps anyway: less memory between forward and backward (per token ``H + F`` elements of
        the GEMM inputs' dtype), a fused norm and activation kernel more in the backward, no GEMM. The
        values are the same bits. Not with ``dot_generals`` (flax's modules cannot run inside it).

    Returns:
      ``(y [..., H_out], new_state)``: new_state as in ``te_jax.dense``, per GEMM (the forward statistics
      ``new_state["fp8_stats"] = {"wi": ..., "wo": ...}`` when ``inspect``).
    """
    where = _WHERE
    inspect = as_sample(inspect)
    q = as_mlp_quantizers(quantizers)
    check_no_dot_general(where, dot_generals, q.any)
    check_recompute(where, recompute_norm_act, dot_generals)
    norm = as_norm(norm_type, zero_centered_gamma, epsilon, gamma, beta, where)
    check_dtypes(where, q.any, x=x, gamma=gamma, beta=beta, kernel_1=kernel_1, bias_1=bias_1, kernel_2=kernel_2,
                 bias_2=bias_2, dropout_mask=dropout_mask)
    h = x.shape[-1]
    if kernel_1.ndim < 2 or kernel_1.shape[0] != h:
        raise ValueError(f"te_jax: {where}: kernel_1 must be [H, ...] with x's H={h}, got {kernel_1.shape}")
    n1 = math.prod(kernel_1.shape[1:])
    f = act_out_features(activation, n1, where)
    if kernel_2.ndim != 2 or kernel_2.shape[0] != f:
        raise ValueError(f"te_jax: {where}: kernel_2 must be [F, H_out] with F={f} ({activation} of a width-{n1} "
                         f"first GEMM), got {kernel_2.shape}")
    if kernel_1.dtype != kernel_2.dtype:
        raise TypeError(f"te_jax: {where}: kernel_1 and kernel_2 must share the compute dtype, got {kernel_1.dtype} "
                        f"and {kernel_2.dtype}")
    if bias_1 is not None and bias_1.shape != kernel_1.shape[1:]:
        raise ValueError(f"te_jax: {where}: bias_1 must have shape {kernel_1.shape[1:]}, got {bias_1.shape}")
    if bias_2 is not None and bias_2.shape != kernel_2.shape[1:]:
        raise ValueError(f"te_jax: {where}: bias_2 must have shape {kernel_2.shape[1:]}, got {bias_2.shape}")
    lead, h_out, dtype = x.shape[:-1], kernel_2.shape[1], kernel_2.dtype
    if dropout_mask is not None and dropout_mask.shape != (*lead, f):
        raise ValueError(f"te_jax: {where}: dropout_mask must have shape {(*lead, f)}, got {dropout_mask.shape}")
    if x.size == 0 or f == 0:  # nothing to normalize or activate: the fused kernels take no empty matrix
        return _unfused(x, gamma, beta, reshape(kernel_1, (h, n1)), None if bias_1 is None else reshape(bias_1, (n1,)),
                        kernel_2, bias_2, dropout_mask, q, state, key, dict(
                            norm_type=norm_type, zero_centered_gamma=zero_centered_gamma, epsilon=epsilon,
                            mesh_resource=mesh_resource, precision=precision, inspect=inspect),
                        activation, dot_generals)
    k1 = reshape(kernel_1, (h, n1))  # a gated [H, 2, F] split along F is unsplit (Explicit meshes: typed)
    b1 = None if bias_1 is None else reshape(bias_1, (n1,))
    mask = None if dropout_mask is None else reshape(dropout_mask.astype(dtype), (-1, f))
    y_type = product_type(x, range(x.ndim - 1), kernel_2, (1,), bias_2)  # as jax types the MLP's output
    if not q.any:
        def high_precision(x, gamma, beta, k1, b1, k2, b2, mask):
            return _high_precision(norm, activation, x, gamma, beta, k1, b1, k2, b2, mask, precision,
                                   dot_generals or (None, None))

        y = recomputing_norm_act(high_precision, recompute_norm_act)(
            x, gamma, beta, k1, b1, kernel_2, bias_2, mask)
        return retype(reshape(y, (*lead, h_out)), y_type), high_precision_state(state, inspect)
    state = dict(state or {})
    inner = {g: check_gemm(qg, state.get(g), key, f"{where} ({g})") for g, qg in q.by_gemm().items()}
    qstats = None
    if inspect:
        given = dict(given_stats(state) or {})
        qstats = {g: stats_input(qg.quantized_roles(), given.get(g)) for g, qg in q.by_gemm().items()}
    mesh_resource = mesh_resource_or_autocast(mesh_resource, x, where=where)
    x2 = reshape(x, (-1, h))
    plan = _MLPPlan(mesh_resource, tuple((g, state_leaves(inner[g])) for g in GEMMS),
                    tuple((g, stats_leaves(qstats[g])) for g in GEMMS) if inspect else (),
                    vary_of(x2, gamma, beta, k1, b1, kernel_2, bias_2, mask), inspect, q, norm,
                    activation, dtype, x.dtype, None if b1 is None else b1.dtype,
                    None if bias_2 is None else bias_2.dtype)
    y, new_inner, fwd_stats = (_recomputing_vjp if recompute_norm_act else _vjp)(
        plan, x2, gamma, beta, k1, b1, kernel_2, bias_2, mask, inner, raw_key(key), qstats)
    updates = {g: {**dict(state.get(g) or {}), **new_inner[g]} for g in GEMMS}
    return retype(reshape(y, (*lead, h_out)), y_type), updated_state(state, updates, fwd_stats)


def _high_precision(norm, activation, x, gamma, beta, k1, b1, k2, b2, mask, precision, dots):
    """Plain autodiff on the unquantized fused kernels: what flax.linen's LayerNorm-Dense-act-Dense computes."""
    dtype = k2.dtype
    ln = normalize(norm, x, gamma, beta, dtype)
    hid = typed_dot(ln, k1, (((ln.ndim - 1,), (0,)), ((), ())), precision=precision, dot=dots[0])
    if b1 is not None:
        hid = hid + b1.astype(hid.dtype)
    a = unquantized_activation(checkpoint_name(hid, PRE_ACTIVATION), activation)
    if mask is not None:
        a = a * mask.reshape(a.shape)
    y = typed_dot(a, k2, (((a.ndim - 1,), (0,)), ((), ())), precision=precision, dot=dots[1])
    return y if b2 is None else y + b2.astype(y.dtype)


def _unfused(x, gamma, beta, k1, b1, k2, b2, mask, q: MLPQuantizers, state, key, options: dict, activation: str,
             dots) -> tuple[jax.Array, dict[str, Any] | None]:
    """``layernorm_dense``, the activation and ``dense`` in turn, for an empty ``x`` or F = 0.

    The fused norm and activation kernels take no empty matrix. The results
    are empty, or (H = 0) the biases' terms; the weights are quantized and
    their state recorded as in the fused form (an empty tensor's amax is 0),
    with the keys and statistics of each GEMM. ``options``: the norm's and
    ``mesh_resource``, ``precision``, ``inspect``.
    """
    state = dict(state or {})
    given = dict(given_stats(state) or {})
    inspect = as_sample(options["inspect"])
    ki, ko = _keys(key)
    hid, wi_state = layernorm_dense(x, gamma, beta, k1, b1, quantizers=q.wi, key=ki,
                                    state=with_stats(state.get("wi"), given.get("wi")),
                                    dot_general=dots[0] if dots else None, **options)
    a = unquantized_activation(hid, activation) if hid.size else jnp.zeros((*hid.shape[:-1], k2.shape[0]), hid.dtype)
    if mask is not None:
        a = a * mask.astype(a.dtype)
    if not q.any:
        y = typed_dot(a, k2, (((a.ndim - 1,), (0,)), ((), ())), precision=options["precision"],
                      dot=dots[1] if dots else None)
        return (y if b2 is None else y + b2.astype(y.dtype)), high_precision_state(state, inspect)
    y, wo_state = dense(a, k2, b2, quantizers=q.wo, key=ko, state=with_stats(state.get("wo"), given.get("wo")),
                        mesh_resource=options["mesh_resource"], inspect=inspect)
    (wi_state, wi_stats), (wo_state, wo_stats) = split_stats(wi_state), split_stats(wo_state)
    return y, updated_state(state, {"wi": wi_state, "wo": wo_state},
                            None if wi_stats is None else {"wi": wi_stats, "wo": wo_stats})


def _keys(key):
    return (None, None) if key is None else (jax.random.fold_in(key, 0), jax.random.fold_in(key, 1))


def _activation_output(plan: _MLPPlan, go: GemmQuant, hid, mask, training: bool):
    """``act(hid)`` written by wo's input quantizer (fused unless dropout sits in between)."""
    if mask is not None:
        a = fused.activation(hid, plan.activation, out_dtype=plan.dtype) * mask
        return go.quantize("input", a, rowwise=True, colwise=training, name=NORM_ACT_OUTPUT)
    if not go.has("input"):
        return fused.activation(hid, plan.activation, out_dtype=plan.dtype)
    return go.run("input", lambda qz, st, k: (fused.activation(hid, plan.activation, qz, st, rowwise=True,
                                                               colwise=training, key=k),),
                  lambda rows: fused.activation(hid[rows], plan.activation, out_dtype=jnp.float32,
                                                backend="reference"), NORM_ACT_OUTPUT)[0]


class _Residuals(NamedTuple):
    """What layernorm_mlp's backward reads (a pytree); per-GEMM entries are ``{"wi": ..., "wo": ...}``."""

    x: Any  # the input (None without a norm)
    gamma: Any
    beta: Any
    norm_stats: Any  # the norm's (mean, rsigma)
    ln: Any  # the normed input quantized, columnwise copy only (wi's wgrad)
    k1: Any  # kernel_1 quantized, rowwise copy only (wi's dgrad)
    hid: Any  # the first GEMM's output (pre-activation), for the activation's gradient
    a: Any  # the activation output quantized, columnwise copy only (wo's wgrad)
    k2: Any  # kernel_2 quantized, rowwise copy only (wo's dgrad)
    mask: Any  # the dropout mask [M, F], or None
    state: dict  # gemm -> role -> incoming state (float32)
    state_grads: dict  # gemm -> role -> the forward roles' state updates (update form)
    key: Any  # raw PRNG key or None
    stats: Any  # gemm -> the forward statistics, or None


def _forward(plan: _MLPPlan, x, gamma, beta, k1, b1, k2, b2, mask, state, key, qstats, training: bool):
    ki, ko = _keys(key)
    gi = GemmQuant(plan.q.wi, state["wi"], ki, plan.mesh_resource, plan.inspect)
    go = GemmQuant(plan.q.wo, state["wo"], ko, plan.mesh_resource, plan.inspect)
    ln, stats = norm_input(plan.norm, gi, x, gamma, beta, plan.dtype, training)
    k1q = gi.quantize("weight", k1, rowwise=training, colwise=True, flatten_axis=1)
    hid = gi.gemm(ln, k1q, ((1,), (0,)), out_dtype=plan.dtype, bias=b1, fast_accum=plan.q.wi.fast_accum)
    hid = checkpoint_name(gi.qdq("output", hid), PRE_ACTIVATION)
    a = _activation_output(plan, go, hid, mask, training)
    k2q = go.quantize("weight", k2, rowwise=training, colwise=True, flatten_axis=1)
    y = go.gemm(a, k2q, ((1,), (0,)), out_dtype=plan.dtype, bias=b2, fast_accum=plan.q.wo.fast_accum)
    y = to_varying(go.qdq("output", y), plan.all_vary)
    res = _Residuals(None if plan.norm is None else x, gamma, beta, stats, keep(ln, "colwise"), keep(k1q, "rowwise"),
                     hid, keep(a, "colwise"), keep(k2q, "rowwise"), mask, {"wi": gi.st, "wo": go.st},
                     {"wi": gi.grads, "wo": go.grads}, key, _stats(gi, go))
    return (y, {"wi": gi.new_state(), "wo": go.new_state()}, _stats(gi, go)), res


def _stats(gi: GemmQuant, go: GemmQuant) -> dict | None:
    return None if gi.stats is None else {"wi": gi.stats, "wo": go.stats}


def _primal(plan, *args):
    return _forward(plan, *args, training=False)[0]


def _fwd(plan, *args):
    return _forward(plan, *args, training=True)


def _bwd(plan: _MLPPlan, res: _Residuals, cts):
    dy = cts[0]
    hid, mask = res.hid, res.mask
    ki, ko = _keys(res.key)
    gi, go = (GemmQuant.backward(qg, res.state[g], k, plan.mesh_resource, plan.inspect, f"{_WHERE} ({g})")
              for (g, qg), k in zip(plan.q.by_gemm().items(), (ki, ko)))
    # Second GEMM. Backward GEMMs split their accumulation unless the recipe asks otherwise, as te_jax.dense does.
    dyq = go.quantize("grad_output", dy, rowwise=True, colwise=True)
    fast_wo = plan.q.wo.backward_fast_accum
    da = go.qdq("grad_input", go.gemm(dyq, res.k2, ((1,), (1,)), out_dtype=plan.dtype, fast_accum=fast_wo))
    dk2 = go.gemm(res.a, dyq, ((0,), (0,)), out_dtype=plan.dtype, fast_accum=fast_wo)
    db2 = None if plan.b2_dtype is None else jnp.sum(dy.astype(jnp.float32), axis=0).astype(plan.b2_dtype)
    if mask is not None:
        da = da * mask
    # Activation backward, fused with the cast of dh (wi's grad_output) and with db1.
    has_b1 = plan.b1_dtype is not None

    def act_grad(qz, s, k):
        return fused.activation_grad(da, hid, plan.activation, qz, s, dbias=has_b1, rowwise=True, colwise=True,
                                     key=k, out_dtype=None if qz is not None else plan.dtype)

    def reference(rows: slice) -> jax.Array:
        return fused.activation_grad(da[rows], hid[rows], plan.activation, out_dtype=jnp.float32,
                                     backend="reference")[0]

    dh, db1 = gi.run("grad_output", act_grad, reference) if gi.has("grad_output") else act_grad(None, None, None)
    db1 = None if not has_b1 else db1.astype(plan.b1_dtype)
    # First GEMM and the norm.
    fast_wi = plan.q.wi.backward_fast_accum
    dln = gi.qdq("grad_input", gi.gemm(dh, res.k1, ((1,), (1,)), out_dtype=plan.dtype, fast_accum=fast_wi))
    dk1 = gi.gemm(res.ln, dh, ((0,), (0,)), out_dtype=plan.dtype, fast_accum=fast_wi)
    dx, dgamma, dbeta = norm_backward(plan.norm, dln, res.x, res.gamma, res.beta, res.norm_stats, plan.x_dtype)
    u = plan.all_vary
    vx, vg, vb, vk1, vb1, vk2, vb2, _ = plan.vary
    new = {"wi": gi, "wo": go}
    leaves = dict(plan.state_leaves)
    dstate = {g: state_cotangent(leaves[g], {**res.state_grads[g], **new[g].grads}, u) for g in GEMMS}
    dstats = None
    if plan.inspect:
        stats_leaves_of = dict(plan.stats_leaves)
        dstats = {g: stats_cotangent(stats_leaves_of[g], {**res.stats[g], **new[g].stats}, u) for g in GEMMS}
    return (cotangent(dx, u, vx), cotangent(dgamma, u, vg), cotangent(dbeta, u, vb), cotangent(dk1, u, vk1),
            cotangent(db1, u, vb1), cotangent(dk2, u, vk2), cotangent(db2, u, vb2), None, dstate, None, dstats)


_vjp = jax.custom_vjp(_primal, nondiff_argnums=(0,))
_vjp.defvjp(_fwd, with_plan_mesh(_bwd))
_recomputing_vjp = recomputing_norm_act(_vjp, True, static_argnums=(0,))  # recompute_norm_act=True
