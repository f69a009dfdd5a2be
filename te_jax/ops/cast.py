"""The cast half of the fused norm/activation ops: the cast spec, result shapes, sharding.

A fused op (``te_jax.ops.norm_act``) computes a float32
output ``y [M, N]`` and writes it through a cast described by a ``CastSpec``
(its FFI attributes are ``CastSpec.attrs``). Every fused FFI target has the
same seven cast results (``CastOutputs``): ``q, s, q_t, s_t, amax, amax_t,
scale``, with the layouts of ``te_jax.ops.quantize``; the pure-JAX twin of the
cast is ``te_jax.spec.reference_norm_act.cast_outputs``. Which scaling mode a
cast mode writes is the registry's (``te_jax.spec.modes.by_cast_mode``).

Quantizers are the quantize layer's business: ``te_jax.quantize.fused`` maps a
quantizer onto a ``CastSpec`` and wraps the results into a ScaledTensor.

Sharding (``te_jax.ops.primitive``): ``cast_tokens`` gives the seven results'
axis tokens. A fused op whose rows are split and whose cast needs the whole
tensor's amax (``SPLIT_CASTS``: fp8_current, nvfp4) runs its kernel with a
float32 output and then ``split_cast``, the sharded quantize: one extra pass
over the output (written and read once in float32), taken only when split.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops import primitive as partition
from te_jax.ops import quantize as qops
from te_jax.spec import modes
from te_jax.spec.modes import CAST_MODES
from te_jax.spec.modes import CastOutputs, CastSpec

SPLIT_CASTS = ("fp8_current", "nvfp4")  # scale from the whole tensor's amax


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
    spec.scaling_mode.check_tiles((m, n), rowwise=spec.rowwise, colwise=spec.colwise or spec.rht)
    if spec.mode == "nvfp4" and m * n >= 2**32:
        raise ValueError("te_jax: NVFP4 supports matrices of fewer than 2^32 elements")
    return spec


def result_shapes(spec: CastSpec, m: int, n: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The seven cast results' shapes for an output ``[m, n]`` (a checked spec)."""
    f32, row, col = jnp.float32, spec.rowwise, spec.colwise

    def sds(shape, dtype, on=True):
        return jax.ShapeDtypeStruct(shape if on else (0,), dtype)

    one = (1,)
    if spec.mode == "none":
        return (sds((m, n), spec.qdtype), sds(one, f32, False), sds(one, spec.qdtype, False),
                *(sds(one, f32, False),) * 4)
    mode, q = spec.scaling_mode, spec.qdtype
    if mode.per_tensor:
        return (sds((m, n), q, row), sds(one, f32), sds((n, m), q, col), sds(one, f32, False), sds(one, f32),
                sds(one, f32, False), sds(one, f32, spec.mode == "fp8_current"))
    p, b, st = mode.pack, mode.block_cols, mode.scale_dtype
    return (sds((m, n // p), q, row), sds((m, n // b), st, row), sds((n, m // p), q, col), sds((n, m // b), st, col),
            sds(one, f32, mode.global_amax), sds(one, f32, mode.global_amax), sds(one, f32, False))


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
    """The seven results' axis tokens (``te_jax.ops.primitive``) for an output ``[m, *cols]``.

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
    spec_mode = spec.scaling_mode
    if spec_mode.per_tensor:
        q, _, q_t, _ = copies(1, 1)
        return q, "~", q_t, "~", "~", "~", "~"
    return (*copies(spec_mode.pack, spec_mode.block_cols), "~", "~", "~")


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


__all__ = ["CAST_MODES", "SPLIT_CASTS", "CastOutputs", "CastSpec", "cast_operands", "cast_reduce", "cast_tokens",
           "check_spec", "result_shapes", "split_cast"]
