"""``dense``: ``y = x @ W + b`` with the forward, dgrad and wgrad GEMMs quantized.

The functional core the Flax layers are built on. It takes the quantizers
and their state explicitly and returns the new state::

    q = DenseQuantizers.from_recipe(recipe)            # one quantizer per role
    state = q.init_state()                              # {} unless a quantizer keeps state
    y, state = dense(x, kernel, bias, quantizers=q, state=state)

GEMMs (``te_jax.ops.gemm.gemm``, one quantization per tensor; the columnwise
copies come from the same quantize call as the rowwise ones)::

    forward  y  = x  (rowwise, linear_input)        @ W  (columnwise, linear_weight)
    dgrad    dx = dy (rowwise, linear_grad_output)  @ W^T (rowwise)
    wgrad    dW = x^T (columnwise)                  @ dy (columnwise)

A quantizer for "linear_output" quantizes then dequantizes ``y`` (after the
bias), one for "linear_grad_input" does the same to ``dx``; gradients pass
straight through those. A role whose quantizer is None stays in high
precision (the GEMM then dequantizes the other operand); with no quantizer at
all this is ``lax.dot_general`` plus bias, exactly what flax.linen computes.

State. ``state`` maps each role whose quantizer is stateful (delayed scaling)
to its state. The returned state is the forward-updated one (input, weight
and output amaxes recorded). The state after forward *and* backward comes
back as the gradient of ``state``: ``te_jax.train.value_and_grad`` returns
it and ``te_jax.train.apply_fp8_update`` (or ``te_jax.train.TrainState``)
applies it; see ``te_jax.quantize.delayed`` for its max-mergeable form.
Stateful amaxes are reduced across devices (``te_jax.ops.sharding.reduce_amax``)
before the state is updated.

Statistics. With ``inspect=True`` (static; Flax layers take it from
``te_jax.autocast(..., inspect=True)``) every quantized tensor's statistics
(``te_jax.core.stats``) are computed from the copies already made. They
travel like the state, under ``state["fp8_stats"]`` (``te_jax.core.STATS``):
the returned state holds the forward ones, and the gradient of
``state["fp8_stats"]`` (zeros when not given) all of them, forward and
backward. Off, nothing of it is traced.

Randomness. Stochastic rounding (NVFP4 gradients) needs ``key``, a PRNG key
that must change every step (e.g. ``jax.random.fold_in(key, step)``); each
role draws from ``jax.random.fold_in(key, ROLES.index(role))``. Flax layers
take it from the "quantize" RNG stream (``te_jax.train.step.QUANTIZE_RNG``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.core import (DenseQuantizers, GemmQuant, Plan, as_quantizers, check_gemm,
                          cotangent, given_stats, high_precision_state, keep, mesh_resource_or_autocast, raw_key,
                          state_cotangent, state_leaves, updated_state, vary_of)
from te_jax.core.bundles import contracting_axes
from te_jax.core.unquantized import check_dtypes
from te_jax.core.gemm_quant import QUANTIZED, name_quantized
from te_jax.recipe.autocast import with_plan_mesh
from te_jax.core.stats import Sample, as_sample, stats_cotangent, stats_input, stats_leaves
from te_jax.ops.sharding import MeshResource, to_varying
from te_jax.ops.sharding_types import dot_general as typed_dot, product_type, retype

__all__ = ["QUANTIZED", "DenseQuantizers", "as_quantizers", "dense", "name_quantized"]

_WHERE = "dense"


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    contracting_dims=((-1,), (0,)),
    quantizers: DenseQuantizers | Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
    key: jax.Array | None = None,
    mesh_resource: MeshResource | None = None,
    precision=None,
    inspect: bool | Sample = False,
) -> tuple[jax.Array, dict[str, Any] | None]:
    """``lax.dot_general(x, kernel, contracting_dims) + bias`` with quantized GEMMs.

    Args:
      x: the input, float32/bfloat16/float16.
      kernel: the weight; the output is x's free axes then kernel's free axes.
      bias: shaped like kernel's free axes, or None.
      contracting_dims: ``((x axes), (kernel axes))``, paired in order.
      quantizers: ``DenseQuantizers`` or a mapping role -> quantizer; None
        computes in high precision.
      state: role -> state for the stateful quantizers (``quantizers.init_state()``),
        and, with ``inspect``, the statistics input ``state["fp8_stats"]``
        (``{role: {stat: f32[]}}``; default ``te_jax.inspect.zeros(quantizers.quantized_roles())``),
        whose value is never read: its gradient is the statistics of every
        role, forward and backward. Other entries are returned unchanged.
      key: PRNG key for stochastic rounding; required when a quantizer uses it.
      mesh_resource: mesh axes amaxes are reduced over inside shard_map;
        None takes the active autocast's (and without one, every manual axis).
      precision: ``lax.dot_general`` precision of the high-precision path.
      inspect: also compute the statistics of every quantized tensor
        (``te_jax.inspect``): True for every row, a ``te_jax.inspect.Sample``
        for every k-th row of activations and gradients; a static choice,
        off by default (then nothing of it is traced).

    Returns:
      ``(y, new_state)``: new_state is the forward-updated ``state`` (float32),
      with the forward statistics under ``"fp8_stats"`` when ``inspect``; None
      when ``state`` is None and nothing is quantized or inspected.
    """
    q = as_quantizers(quantizers)
    inspect = as_sample(inspect)
    check_dtypes(_WHERE, q.any, x=x, kernel=kernel, bias=bias)  # float64 too when not quantizing
    x_c = contracting_axes(contracting_dims[0], x.ndim, "x", _WHERE)
    k_c = contracting_axes(contracting_dims[1], kernel.ndim, "kernel", _WHERE)
    if len(x_c) != len(k_c) or any(x.shape[i] != kernel.shape[j] for i, j in zip(x_c, k_c)):
        raise ValueError(f"te_jax: {_WHERE}: contracting dims {contracting_dims} pair axes of different sizes: "
                         f"x {x.shape}, kernel {kernel.shape}")
    k_free_shape = tuple(d for i, d in enumerate(kernel.shape) if i not in k_c)
    if bias is not None and tuple(bias.shape) != k_free_shape:
        raise ValueError(f"te_jax: {_WHERE}: bias must have kernel's free shape {k_free_shape}, got {bias.shape}")
    if not q.any:
        y = typed_dot(x, kernel, ((x_c, k_c), ((), ())), precision=precision)  # lax's, typed where lax refuses
        if bias is not None:
            y = y + jnp.reshape(bias, (1,) * (y.ndim - bias.ndim) + bias.shape)
        return y, high_precision_state(state, inspect)

    if len(x_c) == x.ndim:  # x has no free axis (rank-1 x): the GEMMs take it as one row
        y, new_state = dense(x[None], kernel, bias, contracting_dims=(tuple(a + 1 for a in x_c), k_c), quantizers=q,
                             state=state, key=key, mesh_resource=mesh_resource, inspect=inspect)
        return y[0], new_state
    # Contracting axes last on x, first on the kernel: flatten_axis then splits them off.
    x_free = tuple(i for i in range(x.ndim) if i not in x_c)
    k_free = tuple(i for i in range(kernel.ndim) if i not in k_c)
    inner = check_gemm(q, state, key, _WHERE)
    x2 = jnp.transpose(x, x_free + x_c) if x_free + x_c != tuple(range(x.ndim)) else x
    k2 = jnp.transpose(kernel, k_c + k_free) if k_c + k_free != tuple(range(kernel.ndim)) else kernel
    qstats = stats_input(q.quantized_roles(), given_stats(state)) if inspect else None
    mesh_resource = mesh_resource_or_autocast(mesh_resource, x, where=_WHERE)
    plan = _DensePlan(mesh_resource, state_leaves(inner), stats_leaves(qstats),
                      vary_of(x2, k2, bias), inspect, q, len(x_free), len(x_c), len(k_free), x.dtype, kernel.dtype,
                      None if bias is None else bias.dtype)
    y, new_inner, fwd_stats = _vjp(plan, x2, k2, bias, inner, raw_key(key), qstats)
    y = retype(y, product_type(x, x_free, kernel, k_free, bias))  # as jax types x @ kernel + bias (Explicit mesh)
    return y, updated_state(state, new_inner, fwd_stats)


@dataclasses.dataclass(frozen=True)
class _DensePlan(Plan):
    """The static facts of one dense call (``vary``: x, kernel, bias)."""

    q: DenseQuantizers
    nb: int  # x's free (batch) axes
    nk: int  # contracting axes
    nn: int  # kernel's free (output) axes
    x_dtype: Any
    k_dtype: Any
    bias_dtype: Any  # None: no bias


class _Residuals(NamedTuple):
    """What dense's backward reads (a pytree)."""

    x: Any  # x quantized, columnwise copy only (wgrad), or x
    kernel: Any  # the kernel quantized, rowwise copy only (dgrad), or the kernel
    state: dict  # role -> incoming state (float32)
    state_grads: dict  # role -> the forward roles' state updates (update form)
    key: Any  # raw PRNG key or None
    stats: Any  # the forward statistics, or None


def _forward(plan: _DensePlan, x, kernel, bias, state, key):
    g = GemmQuant(plan.q, state, key, plan.mesh_resource, plan.inspect)
    xq = g.quantize("input", x, colwise=True, flatten_axis=plan.nb)
    kq = g.quantize("weight", kernel, colwise=True, flatten_axis=plan.nk)
    dims = (tuple(range(plan.nb, plan.nb + plan.nk)), tuple(range(plan.nk)))
    y = g.gemm(xq, kq, dims, out_dtype=jnp.result_type(x.dtype, kernel.dtype), bias=bias,
               fast_accum=plan.q.fast_accum)
    y = to_varying(g.qdq("output", y, flatten_axis=plan.nb), plan.all_vary)  # custom calls drop varying types
    # Keep only the copies the backward GEMMs read: x columnwise (wgrad), W rowwise (dgrad).
    res = _Residuals(keep(xq, "colwise"), keep(kq, "rowwise"), g.st, g.grads, key, g.stats)
    return (y, g.new_state(), g.stats), res


# The statistics input ``qstats`` is never read: its cotangent carries the statistics out of backward.
def _primal(plan, x, kernel, bias, state, key, qstats):
    return _forward(plan, x, kernel, bias, state, key)[0]


def _fwd(plan, x, kernel, bias, state, key, qstats):
    return _forward(plan, x, kernel, bias, state, key)


def _bwd(plan: _DensePlan, res: _Residuals, cotangents):
    dy = cotangents[0]
    g = GemmQuant.backward(plan.q, res.state, res.key, plan.mesh_resource, plan.inspect, _WHERE)
    dyq = g.quantize("grad_output", dy, colwise=True, flatten_axis=plan.nb)
    dy_n = tuple(range(plan.nb, plan.nb + plan.nn))
    k_n = tuple(range(plan.nk, plan.nk + plan.nn))
    # Backward GEMMs split their accumulation unless the recipe asks otherwise (more exact gradients).
    fast = plan.q.backward_fast_accum
    dx = g.qdq("grad_input", g.gemm(dyq, res.kernel, (dy_n, k_n), out_dtype=plan.x_dtype, fast_accum=fast),
               flatten_axis=plan.nb)
    batch = tuple(range(plan.nb))
    dk = g.gemm(res.x, dyq, (batch, batch), out_dtype=plan.k_dtype, fast_accum=fast)
    dbias = None
    if plan.bias_dtype is not None:
        dbias = jnp.sum(dy.astype(jnp.float32), axis=batch).astype(plan.bias_dtype)
    # In shard_map: reduce over the axes an input does not vary over, as JAX's own transposes do.
    u = plan.all_vary
    vx, vk, vbias = plan.vary
    dstats = stats_cotangent(plan.stats_leaves, {**res.stats, **g.stats}, u) if plan.inspect else None
    return (cotangent(dx, u, vx), cotangent(dk, u, vk), cotangent(dbias, u, vbias),
            state_cotangent(plan.state_leaves, {**res.state_grads, **g.grads}, u), None, dstats)


_vjp = jax.custom_vjp(_primal, nondiff_argnums=(0,))
_vjp.defvjp(_fwd, with_plan_mesh(_bwd))
