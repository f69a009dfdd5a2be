"""The cast half of the fused norm/activation ops: specs, result shapes, quantizers.

A fused op (``te_jax.ops.norm``, ``te_jax.ops.activation``) computes a float32
output ``y [M, N]`` and writes it through a cast described by a ``CastSpec``
(defined with the reference, ``te_jax.quantize.ref_norm_act``). Every fused
FFI target has the same seven cast results (see ``cast_outputs`` there):
``q, s, q_t, s_t, amax, amax_t, scale``, with the layouts of
``te_jax.ops.quantize``, so a ``ScaledTensor`` is built from them directly.

``spec_for_quantizer`` maps the built-in quantizers onto a spec;
``run_cast`` is what the high-level ops use: it runs the fused kernel with
the quantizer's spec and returns a ScaledTensor, or, for a quantizer it cannot
fuse (a custom one, 2D blocks), runs the kernel unquantized in float32 and
calls the quantizer on the result.

Sharding (``te_jax.ops.partition``): ``cast_tokens`` gives the seven results'
axis tokens. A fused op whose rows are split and whose cast needs the whole
tensor's amax (``SPLIT_CASTS``: fp8_current, nvfp4) runs its kernel with a
float32 output and then ``split_cast``, the sharded quantize: one extra pass
over the output (written and read once in float32), taken only when split.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops import partition
from te_jax.ops import quantize as qops
from te_jax.quantize.delayed import DelayedScalingQuantizer, as_float32
from te_jax.quantize.quantizers import (
    CurrentScalingQuantizer,
    Float8BlockQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from te_jax.quantize.ref_norm_act import CAST_MODES, CastSpec
from te_jax.quantize.scaled_tensor import ScaledTensor, ScalingMode

BLOCKS = {"mxfp8": qops.MXFP8_BLOCK, "fp8_block": qops.FP8_BLOCK, "nvfp4": qops.NVFP4_BLOCK}
SPLIT_CASTS = ("fp8_current", "nvfp4")  # scale from the whole tensor's amax
_MODE_NAMES = {"mxfp8": "MXFP8", "fp8_block": "Float8 block scaling", "nvfp4": "NVFP4"}


class CastOutputs(NamedTuple):
    """The seven cast results of a fused op (empty ``[0]`` arrays where not produced)."""

    q: jax.Array
    s: jax.Array
    q_t: jax.Array
    s_t: jax.Array
    amax: jax.Array
    amax_t: jax.Array
    scale: jax.Array


def check_spec(spec: CastSpec, in_dtype, m: int, n: int) -> CastSpec:
    """Validates ``spec`` for an output matrix ``[m, n]``; fills in the "none" output dtype."""
    if not isinstance(spec, CastSpec):
        raise TypeError(f"te_jax: spec must be a CastSpec, got {type(spec).__name__}")
    if spec.mode not in CAST_MODES:
        raise ValueError(f"te_jax: unknown cast mode {spec.mode!r}; choose one of {CAST_MODES}")
    if not (spec.rowwise or spec.colwise):
        raise ValueError("te_jax: ask for at least one of rowwise=True or colwise=True")
    if spec.mode == "none":
        if spec.colwise:
            raise ValueError("te_jax: an unquantized output has no columnwise copy; use colwise=False")
        out = jnp.dtype(in_dtype if spec.qdtype is None else spec.qdtype)
        if out not in qops.HIGH_PRECISION_DTYPES:
            raise TypeError(f"te_jax: an unquantized output must be float32, bfloat16 or float16, not {out}")
        return CastSpec("none", out)
    if spec.mode == "nvfp4":
        spec = CastSpec(**{**spec.__dict__, "qdtype": jnp.dtype(jnp.uint8), "rht": bool(spec.rht and spec.colwise)})
    else:
        spec = CastSpec(**{**spec.__dict__, "qdtype": qops.check_fp8_dtype(spec.qdtype)})
        if spec.rht or spec.stochastic_rounding:
            raise ValueError("te_jax: rht and stochastic_rounding apply to the nvfp4 mode only")
    if not (np.isfinite(spec.epsilon) and spec.epsilon >= 0):
        raise ValueError(f"te_jax: amax_epsilon must be a finite number >= 0, got {spec.epsilon}")
    if m == 0 or n == 0:
        raise ValueError(f"te_jax: a quantized output needs a non-empty matrix, got [{m}, {n}]")
    if spec.mode in BLOCKS:
        qops.check_blocks((m, n), BLOCKS[spec.mode], rowwise=spec.rowwise, colwise=spec.colwise or spec.rht,
                          mode=_MODE_NAMES[spec.mode])
    if spec.mode == "nvfp4" and m * n >= 2**32:
        raise ValueError("te_jax: NVFP4 supports matrices of fewer than 2^32 elements")
    return spec


def result_shapes(spec: CastSpec, m: int, n: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The seven cast results' shapes for an output ``[m, n]`` (a checked spec)."""
    f32, row, col = jnp.float32, spec.rowwise, spec.colwise

    def sds(shape, dtype, on=True):
        return jax.ShapeDtypeStruct(shape if on else (0,), dtype)

    one = (1,)
    mode = spec.mode
    if mode == "none":
        return (sds((m, n), spec.qdtype), sds(one, f32, False), sds(one, spec.qdtype, False),
                *(sds(one, f32, False),) * 4)
    if mode in ("fp8_tensor", "fp8_current"):
        q = spec.qdtype
        return (sds((m, n), q, row), sds(one, f32), sds((n, m), q, col), sds(one, f32, False), sds(one, f32),
                sds(one, f32, False), sds(one, f32, mode == "fp8_current"))
    if mode in ("mxfp8", "fp8_block"):
        b, q = BLOCKS[mode], spec.qdtype
        st = jnp.uint8 if mode == "mxfp8" else f32
        return (sds((m, n), q, row), sds((m, n // b), st, row), sds((n, m), q, col), sds((n, m // b), st, col),
                *(sds(one, f32, False),) * 3)
    b, e4 = BLOCKS[mode], jnp.float8_e4m3fn
    return (sds((m, n // 2), jnp.uint8, row), sds((m, n // b), e4, row), sds((n, m // 2), jnp.uint8, col),
            sds((n, m // b), e4, col), sds(one, f32), sds(one, f32), sds(one, f32, False))


def cast_operands(spec: CastSpec, scale, key):
    """The ``scale [1]`` float32 and ``key [2]`` uint32 operands every fused target takes."""
    if spec.mode == "fp8_tensor":
        if scale is None:
            raise ValueError("te_jax: the fp8_tensor mode needs the scale (a float32 [1] array)")
        scale = jnp.asarray(scale, jnp.float32).reshape(1)
    else:
        scale = jnp.ones((1,), jnp.float32)
    if spec.mode == "nvfp4" and spec.stochastic_rounding:
        if key is None:
            raise ValueError("te_jax: NVFP4 stochastic rounding needs a PRNG key")
        words = qops.key_words(key).reshape(2)
    else:
        words = jnp.zeros((2,), jnp.uint32)
    return scale, words


# ---- sharding --------------------------------------------------------------------------


def cast_tokens(spec: CastSpec, cols: tuple[str, ...] = ("n",)) -> tuple[str, ...]:
    """The seven results' axis tokens (``te_jax.ops.partition``) for an output ``[m, *cols]``.

    ``cols`` are the tokens of the output's column axes (``("~", "n")``: a
    gated pair axis before N); block scales count blocks along the last one,
    a columnwise copy is ``[*cols, m]``.
    """
    row, col, mode = spec.rowwise, spec.colwise, spec.mode

    def along(tokens: tuple[str, ...], unit: int) -> str:
        last = tokens[-1] if unit == 1 or tokens[-1] == "~" else f"{tokens[-1]}/{unit}"
        return " ".join((*tokens[:-1], last))

    def copies(unit: int, scale_unit: int) -> tuple[str, str, str, str]:
        return (along(("m", *cols), unit) if row else "~", along(("m", *cols), scale_unit) if row else "~",
                along((*cols, "m"), unit) if col else "~", along((*cols, "m"), scale_unit) if col else "~")

    if mode == "none":
        return (along(("m", *cols), 1), *("~",) * 6)
    if mode in ("fp8_tensor", "fp8_current"):
        q, _, q_t, _ = copies(1, 1)
        return q, "~", q_t, "~", "~", "~", "~"
    if mode in ("mxfp8", "fp8_block"):
        return (*copies(1, BLOCKS[mode]), "~", "~", "~")
    return (*copies(2, BLOCKS[mode]), "~", "~", "~")


def cast_reduce(spec: CastSpec) -> tuple[str | None, ...]:
    """Per cast result, the all-reduce a split output needs: the given-scale amax is a max."""
    return (None,) * 4 + (("max" if spec.mode == "fp8_tensor" else None), None, None)


def split_cast(y, spec: CastSpec, words, shards: partition.Shards) -> tuple:
    """The seven cast results of float32 ``y [..., m, n]``, one device's block of a split output.

    For the ``SPLIT_CASTS`` modes: scaled from the whole tensor's amax (one
    pmax), so the bits equal the unsplit kernel's cast (NVFP4 stochastic
    rounding excepted: its key gets the block's index).
    """
    lead = y.shape[:-2]
    empty = jnp.zeros((*lead, 0), jnp.float32)
    if spec.mode == "fp8_current":
        q, q_t, amax, scale, scale_inv = qops.fp8_current_local(
            y, shards, qdtype=spec.qdtype, rowwise=spec.rowwise, colwise=spec.colwise, power_2=spec.power_2,
            epsilon=spec.epsilon)
        return q, scale_inv, q_t, empty, amax, empty, scale
    q, s, q_t, s_t, amax, amax_t = qops.nvfp4_local(
        y, words, shards, rowwise=spec.rowwise, colwise=spec.colwise, block_2d=False, rht=bool(spec.rht),
        stochastic_rounding=spec.stochastic_rounding)
    return q, s, q_t, s_t, amax, amax_t, empty


# ---- quantizers ------------------------------------------------------------------------


def spec_for_quantizer(quantizer, state=None, *, rowwise=True, colwise=False):
    """``(spec, scale)`` for a built-in quantizer, or None when the cast cannot be fused."""
    if isinstance(quantizer, DelayedScalingQuantizer):
        quantizer.check_state(state)
        return CastSpec("fp8_tensor", quantizer.dtype, rowwise, colwise), as_float32(state)["scale"]
    if isinstance(quantizer, CurrentScalingQuantizer):
        return CastSpec("fp8_current", quantizer.dtype, rowwise, colwise, quantizer.power_2_scales,
                        quantizer.amax_epsilon), None
    if isinstance(quantizer, MXFP8Quantizer):
        return CastSpec("mxfp8", quantizer.dtype, rowwise, colwise), None
    if isinstance(quantizer, Float8BlockQuantizer) and not quantizer.block_2d:
        return CastSpec("fp8_block", quantizer.dtype, rowwise, colwise, quantizer.power_2_scales), None
    if isinstance(quantizer, NVFP4Quantizer) and not quantizer.block_2d:
        return CastSpec("nvfp4", jnp.uint8, rowwise, colwise, rht=quantizer.rht and colwise,
                        stochastic_rounding=quantizer.stochastic_rounding), None
    return None


def scaled_tensor(outs: CastOutputs, spec: CastSpec, quantizer, shape, flatten_axis: int = -1) -> ScaledTensor:
    """The ScaledTensor of logical ``shape`` that ``quantizer.quantize`` would return."""
    row, col, mode = spec.rowwise, spec.colwise, spec.mode
    if mode in ("fp8_tensor", "fp8_current"):
        smode, s, s_t, amax, amax_t, layout = ScalingMode.FP8_TENSOR, outs.s, outs.s, outs.amax, None, {}
    elif mode == "mxfp8":
        smode, s, s_t, amax, amax_t, layout = ScalingMode.MXFP8, outs.s, outs.s_t, None, None, {}
    elif mode == "fp8_block":
        smode, s, s_t, amax, amax_t, layout = ScalingMode.FP8_BLOCK, outs.s, outs.s_t, None, None, {}
    else:
        smode, s, s_t = ScalingMode.NVFP4, outs.s, outs.s_t
        amax, amax_t, layout = outs.amax, (outs.amax_t if col else None), {"rht": bool(spec.rht and col)}
    return ScaledTensor(
        data=outs.q if row else None,
        scale_inv=s if row else None,
        colwise_data=outs.q_t if col else None,
        colwise_scale_inv=s_t if col else None,
        amax=amax,
        colwise_amax=amax_t,
        mode=smode,
        qdtype=jnp.dtype(quantizer.dtype),
        shape=tuple(shape),
        flatten_axis=flatten_axis,
        **layout,
    )


def run_cast(call: Callable, shape, in_dtype, quantizer, state, *, rowwise, colwise, key, out_dtype,
             flatten_axis: int = -1):
    """Runs ``call(spec, scale, key)`` (which returns ``(CastOutputs, *extras)``) for ``quantizer``.

    ``shape`` is the logical output shape, viewed as a matrix around
    ``flatten_axis`` (the kernel's ``[M, N]``). Returns ``(y, *extras)`` with ``y``
    a ScaledTensor, or an array of ``shape`` in ``out_dtype`` (default
    ``in_dtype``) when ``quantizer`` is None.
    """
    if quantizer is None:
        outs, *extras = call(CastSpec("none", out_dtype or in_dtype), None, None)
        return (outs.q.reshape(shape), *extras)
    fused = spec_for_quantizer(quantizer, state, rowwise=rowwise, colwise=colwise)
    if fused is None:
        # Not fusable: the float32 output, then the quantizer itself.
        outs, *extras = call(CastSpec("none", jnp.float32), None, None)
        layout = {} if flatten_axis == -1 else {"flatten_axis": flatten_axis}
        y = quantizer.quantize(outs.q.reshape(shape), state, rowwise=rowwise, colwise=colwise, key=key, **layout)
        return (y, *extras)
    spec, scale = fused
    outs, *extras = call(spec, scale, key)
    return (scaled_tensor(outs, spec, quantizer, shape, flatten_axis), *extras)


__all__ = ["BLOCKS", "SPLIT_CASTS", "CastOutputs", "CastSpec", "cast_operands", "cast_reduce", "cast_tokens",
           "check_spec", "result_shapes", "run_cast", "scaled_tensor", "spec_for_quantizer", "split_cast"]
