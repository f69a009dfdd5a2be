"""``layernorm_dense``: ``y = norm(x) @ W + b`` with the norm fused into the input's quantization.

The functional core of ``te_jax.flax.LayerNormDenseGeneral`` (and, with
``norm_type=None``, of attention output projections). Like ``te_jax.dense``
it takes the quantizers and their state explicitly and returns the new state::

    q = DenseQuantizers.from_recipe(recipe)
    y, state = layernorm_dense(x, gamma, beta, kernel, bias, quantizers=q, state=q.init_state())

Kernels and GEMMs (``x`` viewed as ``[M, H]``, ``W`` as ``[H, N]``)::

    forward  ln, mean, rsigma = te_jax_norm_fwd(x)   ln written rowwise + columnwise by the "linear_input"
                                                     quantizer inside the norm kernel (no bf16 ln in HBM)
             y  = ln (rowwise)  @ W (columnwise, "linear_weight") + b
    dgrad    dln = dy (rowwise, "linear_grad_output") @ W^T (rowwise)
             dx, dgamma, dbeta = te_jax_norm_bwd(dln)
    wgrad    dW = ln^T (columnwise) @ dy (columnwise)

"linear_output" / "linear_grad_input" quantizers quantize-dequantize ``y`` /
``dln`` as in ``te_jax.dense``; a role whose quantizer is None stays in high
precision. Without any quantizer this is ``normalize(x) @ W + b`` on plain
autodiff, which is what flax.linen's LayerNorm followed by DenseGeneral computes.

State, keys, statistics and the state update carried as the gradient of
``state`` work exactly as in ``te_jax.dense`` (all of it is ``te_jax.core``).
When nothing is differentiated (inference), only the copies the forward GEMM
reads are written.

Rematerialization. Every forward quantized copy is named
``checkpoint_name(..., QUANTIZED)`` and the norm statistics ``NORM_STATS``,
so ``save_fp8_policy`` (``jax.checkpoint`` / ``nn.remat`` policy) keeps the
FP8 copies and recomputes only GEMMs and elementwise work in backward, never a
cast (``fp8_checkpoint_policy(PRE_ACTIVATION)`` also keeps an MLP's first GEMM
output). FP8 leaves are named as their uint8 bits: see ``te_jax.core.gemm_quant``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.core import (NORM_STATS, PRE_ACTIVATION, QUANTIZED, DenseQuantizers, GemmQuant, Plan, as_quantizers,
                          check_gemm, check_no_dot_general, cotangent, fp8_checkpoint_policy,
                          given_stats, high_precision_state, keep, mesh_resource_or_autocast, raw_key,
                          save_fp8_policy, state_cotangent, state_leaves, updated_state, vary_of)
from te_jax.core.dense import dense
from te_jax.core.gemm_quant import (NORM_ACT_OUTPUT, NormSpec, as_norm, check_recompute, norm_backward, norm_input,
                                    recomputing_norm_act)
from te_jax.core.unquantized import check_dtypes, normalize
from te_jax.recipe.autocast import with_plan_mesh
from te_jax.core.stats import Sample, as_sample, stats_cotangent, stats_input, stats_leaves
from te_jax.ops.sharding import MeshResource, to_varying
from te_jax.ops.sharding_types import dot_general as typed_dot, product_type, reshape, retype

__all__ = ["NORM_STATS", "PRE_ACTIVATION", "QUANTIZED", "fp8_checkpoint_policy", "layernorm_dense",
           "save_fp8_policy"]

_WHERE = "layernorm_dense"


@dataclasses.dataclass(frozen=True)
class _LayerNormDensePlan(Plan):
    """The static facts of one layernorm_dense call (``vary``: x, gamma, beta, kernel, bias)."""

    q: DenseQuantizers
    norm: NormSpec | None
    dtype: Any  # the kernel's dtype: the compute and output dtype
    x_dtype: Any
    bias_dtype: Any  # None: no bias
    recompute: bool = False  # recompute_norm_act: the backward recomputes the GEMM input's quantized copy


def layernorm_dense(
    x: jax.Array,
    gamma: jax.Array | None,
    beta: jax.Array | None,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    norm_type: str | None = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    quantizers: DenseQuantizers | Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
    key: jax.Array | None = None,
    mesh_resource: MeshResource | None = None,
    precision=None,
    inspect: bool | Sample = False,
    dot_general=None,
    recompute_norm_act: bool = False,
) -> tuple[jax.Array, dict[str, Any] | None]:
    """``norm(x) @ kernel + bias`` over x's last axis, with the norm fused into the input's cast.

    Args:
      x: ``[..., H]``, float32/bfloat16/float16.
      gamma, beta: the norm's ``[H]`` scale and bias (beta None: no bias; rmsnorm has none).
        Both None with ``norm_type=None``.
      kernel: ``[H, *features]``; its dtype is the compute (output) dtype.
      bias: ``features``-shaped, or None.
      norm_type: "layernorm", "rmsnorm", or None (no norm: a dense layer on x's last axis).
      zero_centered_gamma: the norm scales by ``1 + gamma``.
      epsilon: added to the variance.
      quantizers, state, key, mesh_resource: as in ``te_jax.dense``.
      precision: ``lax.dot_general`` precision of the high-precision path.
      inspect: quantization statistics, as in ``te_jax.dense``.
      dot_general: the product of the unquantized path instead of
        ``lax.dot_general`` (e.g. a flax ``Fp8DotGeneral`` instance); only without quantizers.
      recompute_norm_act: with a norm, the backward does not keep the norm's output (its FP8 copy under
        a recipe) but recomputes it from the input, which it keeps anyway (``te_jax.layernorm_mlp``).
        Without a norm, under a recipe, the backward keeps x instead of its FP8 copy and quantizes it
        again (the same bits): less memory only where x is kept for another backward anyway, e.g. an
        attention output that cuDNN's attention keeps (``te_jax.flax.SelfAttention`` does this).
        Not with ``dot_general``.

    Returns:
      ``(y [..., *features], new_state)``, new_state as in ``te_jax.dense``.
    """
    where = _WHERE
    q = as_quantizers(quantizers)
    inspect = as_sample(inspect)
    check_no_dot_general(where, dot_general, q.any)
    check_recompute(where, recompute_norm_act and norm_type is not None, dot_general)  # no norm: no copy to drop
    norm = as_norm(norm_type, zero_centered_gamma, epsilon, gamma, beta, where)
    check_dtypes(where, q.any, x=x, gamma=gamma, beta=beta, kernel=kernel, bias=bias)
    if x.ndim < 1 or kernel.ndim < 2 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(f"te_jax: {where}: x [..., H] and kernel [H, *features] must share H; got x {x.shape}, "
                         f"kernel {kernel.shape}")
    features = kernel.shape[1:]
    if bias is not None and tuple(bias.shape) != features:
        raise ValueError(f"te_jax: {where}: bias must have the kernel's feature shape {features}, got {bias.shape}")
    lead, h, n = x.shape[:-1], x.shape[-1], math.prod(features)
    dtype = kernel.dtype
    if x.size == 0 and q.any:  # no row, or H = 0: the norm's output is empty, and dense's GEMMs take that
        return dense(jnp.zeros(x.shape, dtype), kernel, bias, quantizers=q, state=state, key=key,
                     mesh_resource=mesh_resource, inspect=inspect)
    if not q.any:
        def high_precision(x, gamma, beta, kernel):
            ln = normalize(norm, x, gamma, beta, dtype) if x.size else jnp.zeros(x.shape, dtype)
            return typed_dot(ln, kernel, (((ln.ndim - 1,), (0,)), ((), ())), precision=precision, dot=dot_general)

        y = recomputing_norm_act(high_precision, recompute_norm_act and norm is not None)(x, gamma, beta, kernel)
        if bias is not None:
            y = y + bias.astype(y.dtype)
        return y, high_precision_state(state, inspect)
    inner = check_gemm(q, state, key, where)
    x2, k2 = reshape(x, (-1, h)), reshape(kernel, (h, n))
    b2 = None if bias is None else reshape(bias, (n,))
    qstats = stats_input(q.quantized_roles(), given_stats(state)) if inspect else None
    mesh_resource = mesh_resource_or_autocast(mesh_resource, x, where=where)
    plan = _LayerNormDensePlan(mesh_resource, state_leaves(inner), stats_leaves(qstats),
                               vary_of(x2, gamma, beta, k2, b2), inspect, q, norm, dtype, x.dtype,
                               None if bias is None else bias.dtype, recompute_norm_act)
    y, new_inner, fwd_stats = (_recomputing_vjp if recompute_norm_act else _vjp)(plan, x2, gamma, beta, k2, b2,
                                                                                 inner, raw_key(key), qstats)
    # Typed as jax types norm(x) @ kernel + bias (Explicit meshes).
    y = retype(reshape(y, (*lead, *features)),
               product_type(x, range(x.ndim - 1), kernel, range(1, kernel.ndim), bias))
    return y, updated_state(state, new_inner, fwd_stats)


class _Residuals(NamedTuple):
    """What layernorm_dense's backward reads (a pytree)."""

    x: Any  # the input (None without a norm: the backward needs it for the norm's gradient only)
    gamma: Any
    beta: Any
    norm_stats: Any  # the norm's (mean, rsigma)
    ln: Any  # the normed input quantized, columnwise copy only (wgrad)
    kernel: Any  # the kernel quantized, rowwise copy only (dgrad)
    state: dict  # role -> incoming state (float32)
    state_grads: dict  # role -> the forward roles' state updates (update form)
    key: Any  # raw PRNG key or None
    stats: Any  # the forward statistics, or None


def _forward(plan: _LayerNormDensePlan, x, gamma, beta, kernel, bias, state, key, training: bool):
    g = GemmQuant(plan.q, state, key, plan.mesh_resource, plan.inspect)
    ln, stats = norm_input(plan.norm, g, x, gamma, beta, kernel.dtype, training,
                           NORM_ACT_OUTPUT if plan.recompute else None)
    kq = g.quantize("weight", kernel, rowwise=training, colwise=True, flatten_axis=1)
    y = g.gemm(ln, kq, ((1,), (0,)), out_dtype=kernel.dtype, bias=bias, fast_accum=plan.q.fast_accum)
    y = to_varying(g.qdq("output", y), plan.all_vary)
    res = _Residuals(None if plan.norm is None else x, gamma, beta, stats, keep(ln, "colwise"), keep(kq, "rowwise"),
                     g.st, g.grads, key, g.stats)
    return (y, g.new_state(), g.stats), res


# The statistics input ``qstats`` is never read: its cotangent carries the statistics out of backward.
def _primal(plan, x, gamma, beta, kernel, bias, state, key, qstats):
    return _forward(plan, x, gamma, beta, kernel, bias, state, key, training=False)[0]


def _fwd(plan, x, gamma, beta, kernel, bias, state, key, qstats):
    return _forward(plan, x, gamma, beta, kernel, bias, state, key, training=True)


def _bwd(plan: _LayerNormDensePlan, res: _Residuals, cts):
    dy = cts[0]
    g = GemmQuant.backward(plan.q, res.state, res.key, plan.mesh_resource, plan.inspect, _WHERE)
    dyq = g.quantize("grad_output", dy, rowwise=True, colwise=True)
    # Backward GEMMs split their accumulation unless the recipe asks otherwise, as te_jax.dense does.
    fast = plan.q.backward_fast_accum
    dln = g.qdq("grad_input", g.gemm(dyq, res.kernel, ((1,), (1,)), out_dtype=plan.dtype, fast_accum=fast))
    dk = g.gemm(res.ln, dyq, ((0,), (0,)), out_dtype=plan.dtype, fast_accum=fast)
    db = None if plan.bias_dtype is None else jnp.sum(dy.astype(jnp.float32), axis=0).astype(plan.bias_dtype)
    dx, dgamma, dbeta = norm_backward(plan.norm, dln, res.x, res.gamma, res.beta, res.norm_stats, plan.x_dtype)
    u = plan.all_vary
    vx, vg, vb, vk, vbias = plan.vary
    dstats = stats_cotangent(plan.stats_leaves, {**res.stats, **g.stats}, u) if plan.inspect else None
    return (cotangent(dx, u, vx), cotangent(dgamma, u, vg), cotangent(dbeta, u, vb), cotangent(dk, u, vk),
            cotangent(db, u, vbias), state_cotangent(plan.state_leaves, {**res.state_grads, **g.grads}, u), None,
            dstats)


_vjp = jax.custom_vjp(_primal, nondiff_argnums=(0,))
_vjp.defvjp(_fwd, with_plan_mesh(_bwd))
_recomputing_vjp = recomputing_norm_act(_vjp, True, static_argnums=(0,))  # recompute_norm_act=True
