"""Activations fused with the output's quantization, and their backward fused with dbias.

Activations (float32 math, ``te_jax.quantize.ref_norm_act`` is the reference
twin): ``gelu`` (tanh approximation, ``jax.nn.gelu``'s default), ``relu``,
``silu``, ``squared_relu``, and the gated ``swiglu = silu(a) * g`` and
``geglu = gelu(a) * g``, where the input's last axis is ``[2F]``: ``a =
x[..., :F]`` (the activated half) and ``g = x[..., F:]`` (the gate). A
``[..., 2, F]`` tensor (e.g. a DenseGeneral with ``features=(2, F)``) reshaped
to ``[..., 2F]`` has exactly this layout.

The output ``[M, N_out]`` (``M = prod(x.shape[:-1])``) goes through a cast
(``CastSpec``, see ``te_jax.ops.fused_cast``) with the layouts of
``te_jax.ops.quantize``.

FFI targets (vmap adds leading batch axes to every operand):

``te_jax_act_fwd``
    operands: ``x [..., M, N]``, ``scale f32 [..., 1]``, ``key u32 [..., 2]``
    (dummies unless fp8_tensor / NVFP4 stochastic rounding).
    attributes: ``act`` and the cast's ``mode, rowwise, colwise, power_2,
    amax_epsilon, rht, stochastic_rounding``.
    results: the seven cast results ``q, s, q_t, s_t, amax, amax_t, scale``.

``te_jax_act_bwd``
    operands: ``dy [..., M, N_out]``, ``x [..., M, N]``, ``scale``, ``key``.
    attributes: ``act``, ``dbias`` (bool), and the cast's.
    results: the seven cast results of ``dx [..., M, N]``, ``dbias f32 [...,
    N]`` (``[..., 0]`` unless asked), ``workspace f32 [..., W]``: per-64-row
    partial column sums for dbias on a GPU (``W = ceil(M/64) * N``), else empty.

CUDA fusion: modes none / fp8_tensor / mxfp8 / fp8_block take one pass (read x,
write the copies; a tile transpose for columnwise copies; dbias partials from
the same tile). fp8_current and nvfp4 take an amax pass over x first (no
output written), then the same pass.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

import te_jax._ffi  # noqa: F401  (registers the FFI targets)
from te_jax import backend as backend_lib
from te_jax.ops import quantize as qops
from te_jax.ops.fused_cast import CastOutputs, CastSpec, cast_operands, check_spec, result_shapes, run_cast
from te_jax.quantize import ref_norm_act as rna

ACTIVATIONS = rna.ACTIVATIONS
GATED = rna.GATED
DBIAS_ROWS = 64


def check_act_args(x, act: str) -> int:
    """Validates ``x`` and ``act``; returns the output's last-axis length."""
    qops.check_high_precision(x)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"te_jax: an activation needs x of rank >= 1 with a non-empty last axis, got {x.shape}")
    if act not in ACTIVATIONS:
        raise ValueError(f"te_jax: activation must be one of {ACTIVATIONS}, got {act!r}")
    n = x.shape[-1]
    if act in GATED:
        if n % 2:
            raise ValueError(f"te_jax: {act} takes x [..., 2F] (activated half first); its last axis {n} is odd")
        return n // 2
    return n


def _ffi(target, results, *args, **attrs):
    return jax.ffi.ffi_call(target, results, vmap_method="broadcast_all")(*args, **attrs)


def act_fwd(x, *, act: str, spec: CastSpec = CastSpec(), scale=None, key=None, backend=None) -> CastOutputs:
    """``act(x)`` over ``x [..., N]``, cast as ``spec`` says; matrices are ``[M, N_out]`` / ``[N_out, M]``."""
    n_out = check_act_args(x, act)
    n = x.shape[-1]
    m = math.prod(x.shape[:-1])
    spec = check_spec(spec, x.dtype, m, n_out)
    scale_op, words = cast_operands(spec, scale, key)
    x2 = x.reshape(m, n)
    if backend_lib.resolve(backend) == "reference":
        return CastOutputs(*rna.act_fwd(x2, scale_op, words, act=act, spec=spec))
    outs = _ffi("te_jax_act_fwd", result_shapes(spec, m, n_out), x2, scale_op, words, act=act, **spec.attrs)
    return CastOutputs(*outs)


def act_bwd(dy, x, *, act: str, spec: CastSpec = CastSpec(), scale=None, key=None, dbias=False, backend=None):
    """``dx = dy * act'(x)`` (same shape as x) cast as ``spec`` says, and ``dbias``.

    Returns ``(CastOutputs, dbias)``: dbias is the float32 sum of dx over all
    rows, ``[N]``, or None unless ``dbias=True``. For "none" the output dtype
    defaults to x's.
    """
    n_out = check_act_args(x, act)
    qops.check_high_precision(dy, "dy")
    want = (*x.shape[:-1], n_out)
    if dy.shape != want:
        raise ValueError(f"te_jax: dy must have shape {want} (the activation's output), got {dy.shape}")
    n = x.shape[-1]
    m = math.prod(x.shape[:-1])
    spec = check_spec(spec, x.dtype, m, n)
    scale_op, words = cast_operands(spec, scale, key)
    ct = jnp.promote_types(x.dtype, dy.dtype)  # the kernels take dy and x in one dtype
    x2, dy2 = x.reshape(m, n).astype(ct), dy.reshape(m, n_out).astype(ct)
    if backend_lib.resolve(backend) == "reference":
        outs = rna.act_bwd(dy2, x2, scale_op, words, act=act, spec=spec, dbias=bool(dbias))
    else:
        cast_results = result_shapes(spec, m, n)
        f32 = jnp.float32

        def call(ws: int):
            results = (*cast_results, jax.ShapeDtypeStruct((n if dbias else 0,), f32),
                       jax.ShapeDtypeStruct((ws,), f32))
            return lambda *a: tuple(_ffi("te_jax_act_bwd", results, *a, act=act, dbias=bool(dbias),
                                         **spec.attrs)[:8])

        ws_gpu = -(-m // DBIAS_ROWS) * n if dbias else 0
        outs = lax.platform_dependent(dy2, x2, scale_op, words, cpu=call(0), cuda=call(ws_gpu))
    return CastOutputs(*outs[:7]), (outs[7] if dbias else None)


# ---- quantizer-level and differentiable forms -----------------------------------------


def _out_shape(x, act):
    return (*x.shape[:-1], x.shape[-1] // 2 if act in GATED else x.shape[-1])


def activation(x, act: str, quantizer=None, state=None, *, rowwise=True, colwise=False, key=None, out_dtype=None,
               backend=None):
    """``act(x)`` written through ``quantizer`` (a ScaledTensor), or an array when ``quantizer`` is None."""
    check_act_args(x, act)

    def call(spec, scale, k):
        return (act_fwd(x, act=act, spec=spec, scale=scale, key=k, backend=backend),)

    return run_cast(call, _out_shape(x, act), x.dtype, quantizer, state, rowwise=rowwise, colwise=colwise,
                    key=key, out_dtype=out_dtype)[0]


def activation_grad(dy, x, act: str, quantizer=None, state=None, *, dbias=False, rowwise=True, colwise=False,
                    key=None, out_dtype=None, backend=None):
    """``(dx, dbias)``: dx written through ``quantizer`` (the grad-output quantizer of the layer below)."""
    check_act_args(x, act)

    def call(spec, scale, k):
        return act_bwd(dy, x, act=act, spec=spec, scale=scale, key=k, dbias=dbias, backend=backend)

    return tuple(run_cast(call, x.shape, x.dtype, quantizer, state, rowwise=rowwise, colwise=colwise, key=key,
                          out_dtype=out_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _apply(x, act, backend):
    return activation(x, act, backend=backend)


def _apply_fwd(x, act, backend):
    return activation(x, act, backend=backend), x


def _apply_bwd(act, backend, x, dy):
    return (activation_grad(dy, x, act, backend=backend)[0],)


_apply.defvjp(_apply_fwd, _apply_bwd)


def apply_activation(x, act: str, *, backend=None):
    """Differentiable unquantized activation (output in x's dtype) on the fused kernels."""
    check_act_args(x, act)
    return _apply(x, act, backend)


__all__ = ["ACTIVATIONS", "DBIAS_ROWS", "GATED", "act_bwd", "act_fwd", "activation", "activation_grad",
           "apply_activation", "check_act_args"]
