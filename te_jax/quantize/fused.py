"""Fused norm and activation ops written through a quantizer.

The ops layer (``te_jax.ops.norm_act``) writes a fused
kernel's output through a ``CastSpec``. This module puts quantizers on top:
a quantizer's ``fused_cast(state, rowwise=, colwise=)`` method gives its spec
and scale, the kernel runs with them, and ``ScaledTensor.from_kernel_outputs``
wraps the seven cast results, so the result is the ScaledTensor that
``quantizer.quantize`` would return for the same output.

A quantizer without a fused cast (a custom quantizer without ``fused_cast``,
or a built-in one that returns None for 2D blocks), or a block-scaled one
whose blocks do not tile the output (the fused kernels take whole blocks;
the quantize op pads partial ones), takes the unfused path:
the kernel writes its output in float32, then ``quantizer.quantize`` runs on
it. That costs one float32 write and read of the output plus the separate
quantize kernel, and warns once per quantizer (``UnfusedCastWarning``;
silence it with ``warnings.filterwarnings("ignore", category=UnfusedCastWarning)``).
"""

from __future__ import annotations

import warnings
from typing import Callable

import jax.numpy as jnp

from te_jax.ops import norm_act as act_ops
from te_jax.ops import norm_act as norm_ops
from te_jax.quantize.protocols import FusedCast
from te_jax.spec.modes import CastOutputs, CastSpec
from te_jax.spec.modes import ScaledTensor, flattened_shape


class UnfusedCastWarning(UserWarning):
    """A fused norm / activation wrote float32 and quantized it separately (see the module docstring)."""


def spec_for_quantizer(quantizer, state=None, *, rowwise=True, colwise=False) -> tuple[CastSpec, object] | None:
    """``(spec, scale)`` that fuses ``quantizer`` into a kernel's cast, or None when it cannot be fused."""
    if not isinstance(quantizer, FusedCast):
        return None
    return quantizer.fused_cast(state, rowwise=rowwise, colwise=colwise)


def scaled_tensor(outs: CastOutputs, spec: CastSpec, quantizer, shape, flatten_axis: int = -1) -> ScaledTensor:
    """The ScaledTensor of logical ``shape`` that ``quantizer.quantize`` would return, from a fused cast's results."""
    return ScaledTensor.from_kernel_outputs(
        spec.scaling_mode, quantizer.dtype, shape, q=outs.q, s=outs.s, q_t=outs.q_t, s_t=outs.s_t, amax=outs.amax,
        amax_t=outs.amax_t, rowwise=spec.rowwise, colwise=spec.colwise, flatten_axis=flatten_axis, rht=spec.rht)


def _warn_unfused(quantizer, partial_blocks_of=None) -> None:
    if partial_blocks_of is not None:
        why = f"its blocks do not tile the output matrix {list(partial_blocks_of)}; the quantize op pads them"
    elif isinstance(quantizer, FusedCast):
        why = "its fused_cast returns None (its blocks are not fused)"
    else:
        why = "it has no fused_cast method"
    warnings.warn(
        f"te_jax: {quantizer!r} cannot be fused into the norm/activation kernel ({why}), so the kernel writes its "
        "output in float32 and a separate kernel quantizes it (one extra float32 write and read of the output). "
        "Silence this with warnings.filterwarnings('ignore', category=te_jax.quantize.fused.UnfusedCastWarning).",
        UnfusedCastWarning,
        stacklevel=4,
    )


def run_cast(call: Callable, shape, in_dtype, quantizer, state, *, rowwise, colwise, key, out_dtype,
             flatten_axis: int = -1):
    """Runs ``call(spec, scale, key)`` (which returns ``(CastOutputs, *extras)``) for ``quantizer``.

    ``shape`` is the logical output shape, viewed as a matrix around
    ``flatten_axis`` (the kernel's ``[M, N]``). Returns ``(y, *extras)`` with ``y``
    a ScaledTensor, or an array of ``shape`` in ``out_dtype`` (default
    ``in_dtype``) when ``quantizer`` is None. A quantizer that cannot be fused
    takes the unfused path of the module docstring.
    """
    if quantizer is None:
        outs, *extras = call(CastSpec("none", out_dtype or in_dtype), None, None)
        return (outs.q.reshape(shape), *extras)
    fused = spec_for_quantizer(quantizer, state, rowwise=rowwise, colwise=colwise)
    matrix = flattened_shape(tuple(shape), flatten_axis)
    partial = fused is not None and fused[0].mode != "none" and not fused[0].scaling_mode.tiles(
        matrix, rowwise=fused[0].rowwise, colwise=fused[0].colwise or fused[0].rht)
    if fused is None or partial:
        _warn_unfused(quantizer, matrix if partial else None)
        outs, *extras = call(CastSpec("none", jnp.float32), None, None)
        layout = {} if flatten_axis == -1 else {"flatten_axis": flatten_axis}
        y = quantizer.quantize(outs.q.reshape(shape), state, rowwise=rowwise, colwise=colwise, key=key, **layout)
        return (y, *extras)
    spec, scale = fused
    outs, *extras = call(spec, scale, key)
    return (scaled_tensor(outs, spec, quantizer, shape, flatten_axis), *extras)


def norm(x, gamma, beta=None, quantizer=None, state=None, *, kind="layernorm", zero_centered_gamma=False,
         epsilon=1e-6, rowwise=True, colwise=False, key=None, out_dtype=None, backend=None):
    """The norm of ``x`` written through ``quantizer``: ``(y, mean, rsigma)``.

    ``y`` is the ScaledTensor ``quantizer.quantize(norm(x), state, ...)`` would
    give, or, with ``quantizer=None``, an array of x's shape in ``out_dtype``
    (default x's dtype). For delayed scaling, ``y.amax`` is this step's amax.
    """

    def call(spec, scale, k):
        out = norm_ops.norm_fwd(x, gamma, beta, kind=kind, zero_centered_gamma=zero_centered_gamma, epsilon=epsilon,
                                spec=spec, scale=scale, key=k, backend=backend)
        return out.cast, out.mean, out.rsigma

    return run_cast(call, x.shape, x.dtype, quantizer, state, rowwise=rowwise, colwise=colwise, key=key,
                    out_dtype=out_dtype)


def activation(x, act: str, quantizer=None, state=None, *, rowwise=True, colwise=False, key=None, out_dtype=None,
               pair_axis=False, backend=None):
    """``act(x)`` written through ``quantizer`` (a ScaledTensor), or an array when ``quantizer`` is None.

    ``pair_axis``: a gated ``x [..., 2, F]`` (see ``te_jax.ops.norm_act.act_fwd``); the output is
    ``[..., F]`` either way.
    """
    act_ops.check_act_args(x, act, pair_axis)

    def call(spec, scale, k):
        return (act_ops.act_fwd(x, act=act, spec=spec, scale=scale, key=k, pair_axis=pair_axis, backend=backend),)

    return run_cast(call, act_ops.out_shape(x, act, pair_axis), x.dtype, quantizer, state, rowwise=rowwise,
                    colwise=colwise, key=key, out_dtype=out_dtype)[0]


def activation_grad(dy, x, act: str, quantizer=None, state=None, *, dbias=False, rowwise=True, colwise=False,
                    key=None, out_dtype=None, pair_axis=False, backend=None):
    """``(dx, dbias)``: dx written through ``quantizer`` (the grad-output quantizer of the layer below).

    With ``pair_axis`` (x ``[..., 2, F]``): dx has x's shape, a ScaledTensor
    with ``flatten_axis=-2`` (the matrix ``[M, 2F]``, as the kernel wrote it;
    where F is sharded that reshape is a resharding, so a tensor-parallel
    consumer should take ``act_bwd``'s pair-form arrays), and dbias is ``[2, F]``.
    """
    act_ops.check_act_args(x, act, pair_axis)

    def call(spec, scale, k):
        outs, db = act_ops.act_bwd(dy, x, act=act, spec=spec, scale=scale, key=k, dbias=dbias, pair_axis=pair_axis,
                                   backend=backend)
        return (act_ops.matrix_form(outs) if pair_axis and quantizer is not None else outs), db

    return tuple(run_cast(call, x.shape, x.dtype, quantizer, state, rowwise=rowwise, colwise=colwise, key=key,
                          out_dtype=out_dtype, flatten_axis=-2 if pair_axis else -1))


__all__ = ["UnfusedCastWarning", "activation", "activation_grad", "norm", "run_cast", "scaled_tensor",
           "spec_for_quantizer"]
